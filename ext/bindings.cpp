// The only file that includes pybind11: exposes the native core as
// aiodatadist._native. Every blocking call releases the GIL.
#include <pybind11/eval.h>
#include <pybind11/native_enum.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core.hpp"
#include "serve.hpp"

namespace py = pybind11;
using namespace aiodd;

namespace {

py::object g_native_error;

// Python's NativeError carries .status (Status) and .errno besides the message.
const char* kNativeErrorSrc = R"(
class NativeError(Exception):
    """A failure in the native core; ``status`` is a :class:`Status`, ``errno`` the OS error (0 if none)."""

    def __init__(self, status, message, errno=0):
        super().__init__(message)
        self.status = Status(status)
        self.errno = errno

    def __reduce__(self):
        return (type(self), (int(self.status), str(self), self.errno))
)";


}  // namespace

#ifndef AIODATADIST_VERSION  // set by CMakeLists.txt from aiodatadist/_version.py
#define AIODATADIST_VERSION "unknown"
#endif

PYBIND11_MODULE(_native, m) {
  m.doc() = "aiodatadist native core: plans, movers, shared memory (private; use the aiodatadist API)";
  m.attr("__version__") = AIODATADIST_VERSION;
  m.attr("IOV_MAX") = iov_max();
  m.attr("CHUNK_BYTES") = kChunk;

  py::native_enum<Status>(m, "Status", "enum.IntEnum")
      .value("OK", Status::OK)
      .value("FAILED", Status::FAILED)
      .value("PARAM_INVALID", Status::PARAM_INVALID)
      .value("OUT_OF_RANGE", Status::OUT_OF_RANGE)
      .value("OVERLAP", Status::OVERLAP)
      .value("ABORTED", Status::ABORTED)
      .value("TIMEOUT", Status::TIMEOUT)
      .value("PERMISSION_DENIED", Status::PERMISSION_DENIED)
      .value("NO_SUCH_PROCESS", Status::NO_SUCH_PROCESS)
      .value("PEER_CLOSED", Status::PEER_CLOSED)
      .value("IO_ERROR", Status::IO_ERROR)
      .value("NO_MEMORY", Status::NO_MEMORY)
      .value("STALE", Status::STALE)
      .finalize();

  py::exec(kNativeErrorSrc, m.attr("__dict__"));
  g_native_error = m.attr("NativeError");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      py::object err = g_native_error(static_cast<int>(e.status()), e.what(), e.sys_errno());
      PyErr_SetObject(g_native_error.ptr(), err.ptr());
    } catch (const std::bad_alloc&) {
      py::object err = g_native_error(static_cast<int>(Status::NO_MEMORY), "out of memory", 0);
      PyErr_SetObject(g_native_error.ptr(), err.ptr());
    }
  });

  py::class_<Control>(m, "Control")
      .def(py::init<>())
      .def("abort", &Control::abort)
      // (Python polls for "stop now": a passed deadline aborts the job here too.)
      .def_property_readonly("aborted", &Control::due)
      .def_property_readonly("bytes_done", &Control::bytes_done)
      .def_property_readonly("total", &Control::total)
      .def("reset", &Control::reset)
      .def("expire_in", &Control::expire_in, py::arg("seconds"))
      .def_property_readonly("expired", &Control::expired)
      .def("__repr__", [](const Control& c) {
        return "<Control aborted=" + std::string(c.aborted() ? "True" : "False") +
               " bytes_done=" + std::to_string(c.bytes_done()) + " total=" + std::to_string(c.total()) + ">";
      });

  py::class_<Geometry>(m, "Geometry")
      .def(py::init<uint64_t, uint64_t, uint64_t>(), py::arg("num_tensors"), py::arg("num_blocks"),
           py::arg("block_bytes"))
      .def_readonly("num_tensors", &Geometry::num_tensors)
      .def_readonly("num_blocks", &Geometry::num_blocks)
      .def_readonly("block_bytes", &Geometry::block_bytes)
      .def_property_readonly("tensor_bytes", &Geometry::tensor_bytes)
      .def("__repr__", [](const Geometry& g) {
        return "<Geometry num_tensors=" + std::to_string(g.num_tensors) + " num_blocks=" +
               std::to_string(g.num_blocks) + " block_bytes=" + std::to_string(g.block_bytes) + ">";
      });

  py::class_<Plan>(m, "Plan")
      .def_static("blocks", &Plan::blocks, py::arg("src"), py::arg("dst"), py::arg("src_blocks"),
                  py::arg("dst_blocks"), py::arg("src_tensor_start"), py::arg("dst_tensor_start"),
                  py::arg("tensor_count"))
      .def_static(
          "from_segments",
          [](const Geometry& src, const Geometry& dst,
             py::array_t<uint64_t, py::array::c_style | py::array::forcecast> arr) {
            if (arr.ndim() != 2 || arr.shape(1) != 5)
              throw Error(Status::PARAM_INVALID, "segments must be an (n, 5) array");
            std::vector<Segment> segs(static_cast<size_t>(arr.shape(0)));
            auto r = arr.unchecked<2>();
            for (py::ssize_t i = 0; i < arr.shape(0); ++i)
              segs[static_cast<size_t>(i)] = {r(i, 0), r(i, 1), r(i, 2), r(i, 3), r(i, 4)};
            return Plan::from_segments(src, dst, std::move(segs));
          },
          py::arg("src"), py::arg("dst"), py::arg("segments"))
      .def_property_readonly("src", &Plan::src)
      .def_property_readonly("dst", &Plan::dst)
      .def_property_readonly("num_segments", [](const Plan& p) { return p.segments().size(); })
      // Each layer's end (segment index) when layer k writes destination tensors
      // [first + k * tensors, first + (k + 1) * tensors): the bounds of the layered movers.
      .def(
          "layer_bounds",
          [](const Plan& p, uint64_t first, uint64_t tensors, uint64_t count) {
            const auto& segs = p.segments();
            if (tensors == 0 || count == 0) throw Error(Status::PARAM_INVALID, "layer_bounds: no layers");
            std::vector<uint64_t> out;
            out.reserve(count);
            uint64_t layer = 0;
            for (size_t i = 0; i < segs.size(); ++i) {
              uint64_t t = segs[i].dst_tensor;
              if (t < first || (t - first) / tensors >= count || (t - first) / tensors < layer)
                throw Error(Status::PARAM_INVALID, "layer_bounds: the plan's segments do not cut into these layers");
              uint64_t l = (t - first) / tensors;
              while (layer < l) {
                if (i == 0 || (!out.empty() && out.back() == i))
                  throw Error(Status::PARAM_INVALID, "layer_bounds: a layer has no segment");
                out.push_back(i);
                ++layer;
              }
            }
            if (layer + 1 != count || segs.empty())
              throw Error(Status::PARAM_INVALID, "layer_bounds: a layer has no segment");
            out.push_back(segs.size());
            return out;
          },
          py::arg("first_tensor"), py::arg("tensors"), py::arg("count"))
      .def_property_readonly("total_bytes", &Plan::total_bytes)
      .def("segments",
           [](const Plan& p) {
             const auto& s = p.segments();
             py::array_t<uint64_t> out({static_cast<py::ssize_t>(s.size()), py::ssize_t{5}});
             auto w = out.mutable_unchecked<2>();
             for (size_t i = 0; i < s.size(); ++i) {
               auto j = static_cast<py::ssize_t>(i);
               w(j, 0) = s[i].src_tensor;
               w(j, 1) = s[i].src_off;
               w(j, 2) = s[i].dst_tensor;
               w(j, 3) = s[i].dst_off;
               w(j, 4) = s[i].nbytes;
             }
             return out;
           })
      .def("__repr__", [](const Plan& p) {
        return "<Plan segments=" + std::to_string(p.segments().size()) +
               " total_bytes=" + std::to_string(p.total_bytes()) + ">";
      });

  using gil_release = py::call_guard<py::gil_scoped_release>;
  m.def("copy_local", &copy_local, py::arg("plan"), py::arg("src_bases"), py::arg("dst_bases"),
        py::arg("control"), py::arg("threads") = 1, gil_release());
  // Copy kernels of copy_local (movers.cpp): "auto", "memcpy" or "stream"; process-wide.
  m.def(
      "set_copy_mode",
      [](const std::string& mode) {
        if (mode == "auto") set_copy_mode(CopyMode::AUTO);
        else if (mode == "memcpy") set_copy_mode(CopyMode::MEMCPY);
        else if (mode == "stream") set_copy_mode(CopyMode::STREAM);
        else throw Error(Status::PARAM_INVALID, "copy mode must be 'auto', 'memcpy' or 'stream', got '" + mode + "'");
      },
      py::arg("mode"));
  m.def("copy_mode", []() {
    CopyMode c = copy_mode();
    return std::string(c == CopyMode::MEMCPY ? "memcpy" : c == CopyMode::STREAM ? "stream" : "auto");
  });
  m.attr("STREAM_SUPPORTED") = stream_supported();
  m.attr("STREAM_THRESHOLD") = stream_threshold();
  m.def("cma_read", &cma_read, py::arg("pid"), py::arg("plan"), py::arg("remote_src_bases"),
        py::arg("local_dst_bases"), py::arg("control"), py::arg("threads") = 1, gil_release());
  m.def("copy_local_layered", &copy_local_layered, py::arg("plan"), py::arg("src_bases"),
        py::arg("dst_bases"), py::arg("bounds"), py::arg("control"), py::arg("threads"), py::arg("efd"),
        py::arg("lease_addr") = 0, py::arg("lease_gen") = 0, gil_release());
  m.def("cma_read_layered", &cma_read_layered, py::arg("pid"), py::arg("plan"), py::arg("remote_src_bases"),
        py::arg("local_dst_bases"), py::arg("bounds"), py::arg("control"), py::arg("threads"), py::arg("efd"),
        py::arg("lease_addr") = 0, py::arg("lease_gen") = 0, gil_release());
  // A layered pull started on a mover pool thread now (GIL held: no thread switch before
  // the first byte); the executor's worker only waits (see _executor.Prestart).
  py::class_<StartedJob>(m, "StartedJob")
      .def("wait", &StartedJob::wait, gil_release())
      .def_property_readonly("done", &StartedJob::done);
  m.def("start_layered", &start_layered, py::arg("pid"), py::arg("plan"), py::arg("src_bases"),
        py::arg("dst_bases"), py::arg("bounds"), py::arg("control"), py::arg("threads"), py::arg("efd"),
        py::arg("lease_addr"), py::arg("lease_gen"), py::arg("nice"), py::keep_alive<0, 2>(),
        py::keep_alive<0, 6>(), py::return_value_policy::take_ownership);
  m.def("cma_write", &cma_write, py::arg("pid"), py::arg("plan"), py::arg("local_src_bases"),
        py::arg("remote_dst_bases"), py::arg("control"), py::arg("threads") = 1, gil_release());
  m.def("sock_send", &sock_send, py::arg("fds"), py::arg("plan"), py::arg("src_bases"), py::arg("control"),
        py::kw_only(), py::arg("tag"), gil_release());
  m.def("sock_recv", &sock_recv, py::arg("fds"), py::arg("plan"), py::arg("dst_bases"), py::arg("control"),
        py::kw_only(), py::arg("tag"), gil_release());
  m.def("sock_recv_layered", &sock_recv_layered, py::arg("fds"), py::arg("plan"), py::arg("dst_bases"),
        py::arg("control"), py::kw_only(), py::arg("tag"), py::arg("ends"), py::arg("efd"), gil_release());
  py::class_<SockStep>(m, "SockStep")
      .def(py::init<int, const Plan&, const std::vector<uint64_t>&, bool, uint64_t>(), py::arg("fd"),
           py::arg("plan"), py::arg("bases"), py::arg("send"), py::kw_only(), py::arg("tag"))
      .def("step", &SockStep::step, gil_release())
      .def_property_readonly("finished", &SockStep::finished)
      .def_property_readonly("sending", &SockStep::sending)
      .def_property_readonly("fd", &SockStep::fd)
      .def_property_readonly("bytes_done", &SockStep::bytes_done)
      .def_property_readonly("total", &SockStep::total)
      .def("step_for", &SockStep::step_for, py::arg("timeout_us"), gil_release())
      .def("run", &SockStep::run, py::arg("control"), gil_release())
      .def_property_readonly("refused", &SockStep::refused)
      .def_property_readonly("refusal", [](const SockStep& s) { return py::bytes(s.refusal()); });
  m.attr("SOCK_REFUSAL_MAGIC") = py::bytes(kRefusalMagic, sizeof kRefusalMagic);
  m.attr("SOCK_MAX_REFUSAL_BYTES") = kMaxRefusalBytes;
  // Stream requests (transports/tcp_streams): a plan's segments as the wire's rows
  // (5 little-endian uint64 each) and back, without numpy.
  m.def(
      "plan_segment_bytes",
      [](const Plan& p) {
        const auto& segs = p.segments();
        std::string out(segs.size() * 40, '\0');
        for (size_t i = 0; i < segs.size(); ++i) {
          const Segment& g = segs[i];
          uint64_t row[5] = {g.src_tensor, g.src_off, g.dst_tensor, g.dst_off, g.nbytes};
          for (int k = 0; k < 5; ++k)
            for (int j = 0; j < 8; ++j) out[i * 40 + k * 8 + j] = static_cast<char>(row[k] >> (8 * j));
        }
        return py::bytes(out);
      },
      py::arg("plan"));
  m.def(
      "plan_from_segment_bytes",
      [](const Geometry& src, const Geometry& dst, const py::bytes& data, size_t offset) {
        std::string_view v(data);
        if (offset > v.size() || (v.size() - offset) % 40 != 0)
          throw Error(Status::PARAM_INVALID, "segments: not a whole number of 40-byte rows");
        const auto* b = reinterpret_cast<const uint8_t*>(v.data()) + offset;
        std::vector<Segment> segs((v.size() - offset) / 40);
        auto u64 = [](const uint8_t* q) {
          uint64_t x = 0;
          for (int j = 0; j < 8; ++j) x |= static_cast<uint64_t>(q[j]) << (8 * j);
          return x;
        };
        for (size_t i = 0; i < segs.size(); ++i, b += 40)
          segs[i] = {u64(b), u64(b + 8), u64(b + 16), u64(b + 24), u64(b + 32)};
        return Plan::from_segments(src, dst, std::move(segs));
      },
      py::arg("src"), py::arg("dst"), py::arg("data"), py::arg("offset") = 0);
  // A layered tcp pull on n streams: the plan reordered so that each stream's share (as
  // the socket movers split a plan) carries 1/n of every layer, in layer order, and where
  // each layer's part ends in a share; None when a layer's bytes do not divide by n.
  m.def(
      "plan_striped",
      [](const Plan& plan, const std::vector<uint64_t>& bounds, size_t n) -> py::object {
        const auto& segs = plan.segments();
        if (n == 0 || bounds.empty() || bounds.back() != segs.size())
          throw Error(Status::PARAM_INVALID, "plan_striped: bounds must end at the segment count");
        std::vector<std::vector<Segment>> shares(n);
        std::vector<uint64_t> ends;
        uint64_t at = 0;
        size_t start = 0;
        for (uint64_t end : bounds) {
          if (end <= start) throw Error(Status::PARAM_INVALID, "plan_striped: bounds must ascend");
          uint64_t size = 0;
          for (size_t j = start; j < end; ++j) size += segs[j].nbytes;
          if (size % n != 0) return py::none();
          const uint64_t part = size / n;
          size_t i = 0;
          uint64_t left = part;
          for (size_t j = start; j < end; ++j) {
            const Segment& g = segs[j];
            for (uint64_t off = 0; off < g.nbytes;) {
              uint64_t take = std::min(g.nbytes - off, left);
              shares[i].push_back({g.src_tensor, g.src_off + off, g.dst_tensor, g.dst_off + off, take});
              off += take;
              left -= take;
              if (left == 0) {
                ++i;
                left = part;
              }
            }
          }
          at += part;
          ends.push_back(at);
          start = end;
        }
        std::vector<Segment> out;
        for (auto& sh : shares) out.insert(out.end(), sh.begin(), sh.end());
        return py::make_tuple(Plan::from_segments(plan.src(), plan.dst(), std::move(out)), ends);
      },
      py::arg("plan"), py::arg("bounds"), py::arg("streams"));
  m.attr("SOCK_HEADER_BYTES") = kStreamHeaderBytes;
  m.def(
      "sock_header",
      [](uint64_t tag, uint64_t nbytes) {
        auto h = stream_header(tag, nbytes);
        return py::bytes(reinterpret_cast<const char*>(h.data()), h.size());
      },
      py::arg("tag"), py::arg("nbytes"));
  m.def(
      "cma_probe",
      [](int pid) {
        int e = cma_probe(pid);
        return py::make_tuple(e == 0, e);
      },
      py::arg("pid"));

  // Leases (lease.cpp): every function takes the address of a slot in a mapped lease page.
  m.attr("LEASE_SLOT_BYTES") = kLeaseSlotBytes;
  m.attr("LEASE_REVOKED") = kLeaseRevoked;
  py::class_<LaneCopy>(m, "LaneCopy")
      .def(py::init<int, const Geometry&, const Geometry&, std::vector<uint64_t>, std::vector<uint64_t>,
                    uint64_t, uint64_t, uint64_t>(),
           py::arg("pid"), py::arg("src"), py::arg("dst"), py::arg("src_bases"), py::arg("dst_bases"),
           py::arg("lease_addr"), py::arg("lease_gen"), py::arg("max_bytes"))
      .def("pull", &LaneCopy::pull, py::arg("src_blocks"), py::arg("dst_blocks"),
           py::arg("src_tensor_start"), py::arg("dst_tensor_start"), py::arg("tensor_count"), gil_release());
  // Native serving of tcp stream requests (serve.hpp).
  py::class_<ServeBook, std::shared_ptr<ServeBook>>(m, "ServeBook")
      .def(py::init<uint64_t>(), py::arg("slots"))
      .def_property_readonly("slots", &ServeBook::slots)
      .def("slot_addr", &ServeBook::slot_addr, py::arg("slot"))
      .def("put", &ServeBook::put, py::arg("cache_id"), py::arg("slot"), py::arg("gen"), py::arg("geometry"),
           py::arg("bases"), py::arg("device"))
      .def("remove", &ServeBook::remove, py::arg("cache_id"))
      .def("__contains__", [](const ServeBook& b, uint64_t id) { return b.find(id) != nullptr; })
      .def("__len__", &ServeBook::size);
  py::class_<StreamServer>(m, "StreamServer")
      .def(py::init([](std::shared_ptr<ServeBook> book, double cap_s, uint64_t max_bytes,
                       std::vector<int64_t> codes, int64_t not_exist) {
             return new StreamServer(std::move(book), cap_s, max_bytes, RefusalCodes{std::move(codes), not_exist});
           }),
           py::arg("book"), py::arg("cap_s"), py::arg("max_bytes"), py::arg("codes"), py::arg("not_exist"))
      .def("serve", &StreamServer::serve, py::arg("fd"))
      .def("retire", &StreamServer::retire)
      .def("stop", &StreamServer::stop, gil_release())
      .def_property_readonly("served", &StreamServer::served)
      .def_property_readonly("failed", &StreamServer::failed)
      .def_property_readonly("bytes", &StreamServer::bytes)
      .def_property_readonly("busy", &StreamServer::busy);
  m.def("lease_enter", &lease_enter, py::arg("addr"), py::arg("gen"));
  m.def("lease_exit", &lease_exit, py::arg("addr"));
  m.def("lease_publish", &lease_publish, py::arg("addr"), py::arg("gen"));
  m.def("lease_gen", &lease_gen, py::arg("addr"));
  m.def("lease_readers", &lease_readers, py::arg("addr"));
  m.def("lease_set_fences", &lease_set_fences, py::arg("addr"), py::arg("n"));
  m.def("lease_fences", &lease_fences, py::arg("addr"));
  m.def("lease_revoke", &lease_revoke, py::arg("addr"), py::arg("timeout_s"), gil_release());

  // The buffer protocol lets numpy views keep a segment mapped: a segment is
  // unmapped by close() or, when nothing refers to it any more, by its destructor.
  py::class_<ShmSegment, std::unique_ptr<ShmSegment>>(m, "ShmSegment", py::buffer_protocol())
      .def_buffer([](ShmSegment& s) -> py::buffer_info {
        if (s.closed()) throw Error(Status::PARAM_INVALID, "shm segment '" + s.name() + "' is closed");
        return py::buffer_info(reinterpret_cast<void*>(s.addr()), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(s.size())}, {py::ssize_t{1}}, !s.writable());
      })
      .def_static("create", &ShmSegment::create, py::arg("name"), py::arg("size"))
      .def_static(
          "from_fd",
          [](int fd, uint64_t size, bool writable, const std::string& name) {
            return ShmSegment::from_fd(fd, size, writable, name);
          },
          py::arg("fd"), py::arg("size"), py::arg("writable") = false, py::arg("name") = std::string("?"))
      .def_property_readonly("name", &ShmSegment::name)
      .def_property_readonly("size", &ShmSegment::size)
      .def_property_readonly("addr", &ShmSegment::addr)
      .def_property_readonly("fd", &ShmSegment::fd)
      .def_property_readonly("owner", &ShmSegment::owner)
      .def_property_readonly("closed", &ShmSegment::closed)
      .def_property_readonly("populated", &ShmSegment::populated)
      .def_property_readonly("writable", &ShmSegment::writable)
      .def("close", &ShmSegment::close)
      .def("__repr__", [](const ShmSegment& s) {
        return "<ShmSegment name='" + s.name() + "' size=" + std::to_string(s.size()) +
               (s.closed() ? " closed" : "") + ">";
      });
}
