"""Which clients a process owns: client id % P == p, and its local index id // P.

It lives in the data layer because the data are laid out by it (each process holds only its
own clients' examples, `data.windows`, and generates only its own clients, `data.synthetic`);
`core.round.distributed` re-exports it for everything above.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ProcessLayout:
    """This process (`index` of `count`) and the clients it owns: id % count == index."""

    index: int = 0
    count: int = 1

    def owns(self, client_ids) -> np.ndarray:
        return np.asarray(client_ids) % self.count == self.index

    def local_index(self, client_ids) -> np.ndarray:
        """The position of owned clients among this process's clients."""
        return np.asarray(client_ids) // self.count

    def num_local(self, num_clients: int) -> int:
        """How many of `num_clients` clients this process owns."""
        return len(range(self.index, num_clients, self.count))

    def owned(self, num_clients: int) -> np.ndarray:
        """The ids of this process's clients among `num_clients`, ascending."""
        return np.arange(self.index, num_clients, self.count)

    def tag(self) -> str:
        """A file-name tag for what this process writes, e.g. '0-of-2'."""
        return f"{self.index}-of-{self.count}"
