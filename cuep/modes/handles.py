"""What the normal modes' dispatch handles share: they iterate as a flat tuple of arrays, as DeepEP's
handle does, so frameworks can save them with their tensors and pass the tuple back."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np


class FlatHandle:
    """Base of a mode's Handle dataclass: its flat tuple is its GPU arrays (:attr:`ARRAY_DTYPES`, in
    order), then ``scalars``, a host ``int64`` array of the counts :meth:`scalars` gives."""

    #: The handle's GPU arrays and their dtypes, in the order of its flat tuple.
    ARRAY_DTYPES: ClassVar[dict[str, Any]]

    def scalars(self) -> list[int]:
        """The host counts that end the flat tuple."""
        raise NotImplementedError

    def __iter__(self):
        # An array given as a torch tensor (is_token_in_rank) goes back as the caller's own tensor.
        return iter((*(_exported(getattr(self, name)) for name in self.ARRAY_DTYPES),
                     np.array(self.scalars(), dtype=np.int64)))

    def __len__(self) -> int:
        return len(self.ARRAY_DTYPES) + 1

    @classmethod
    def item_names(cls) -> tuple[str, ...]:
        """The flat tuple's items by name: the GPU arrays, then ``scalars``."""
        return (*cls.ARRAY_DTYPES, "scalars")

    @classmethod
    def check_dtypes(cls, arrays: dict[str, Any]) -> None:
        """Raises ``ValueError`` naming the first GPU array of ``arrays`` whose dtype is not its own."""
        for name, dtype in cls.ARRAY_DTYPES.items():
            if arrays[name].dtype != dtype:
                raise ValueError(f"handle item {name} must be {np.dtype(dtype)}, got {arrays[name].dtype}")


def _exported(array: Any) -> Any:
    return getattr(array, "tensor", array)
