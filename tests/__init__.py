"""The test suite. Every directory in it is a package: test helpers are imported
absolutely (``from tests.engine._util import ...``), never by a bare name on ``sys.path``."""
