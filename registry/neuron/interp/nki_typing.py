"""``nki.typing`` of the interpreter: shape annotations for kernel parameters (``def k(x: nt.tensor[128, 512])``,
NKI 0.3.0 migration guide). Annotations document; the interpreter does not enforce them."""

from __future__ import annotations


class _Tensor:
    def __getitem__(self, shape):
        return tuple(shape) if isinstance(shape, tuple) else (shape,)


tensor = _Tensor()

__all__ = ["tensor"]
