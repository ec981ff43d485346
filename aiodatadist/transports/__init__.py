"""Data paths, one module each, behind the :class:`.base.Channel` interface."""

from .base import Call, Channel

__all__ = ["Call", "Channel"]
