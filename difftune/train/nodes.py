"""Several machines ("nodes") in one run: where each process sits, the launch line that starts
them, and the batch and learning-rate arithmetic `difftune check --nodes N` prints.

torch-free (the CLI and `check` read it before torch loads). torchrun numbers the processes of
node k as the contiguous global ranks k*G ... k*G+G-1 (G processes per node) and tells each
process its node (`GROUP_RANK`), its place on the node (`LOCAL_RANK`) and G (`LOCAL_WORLD_SIZE`).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

# The port the documented launch line gives the rendezvous (torchrun's own default).
PORT = 29500


@dataclass(frozen=True)
class Layout:
    """How many nodes a run spans and how many processes each runs."""

    nodes: int = 1
    per_node: int = 1

    @property
    def world(self) -> int:
        """Processes in all."""
        return self.nodes * self.per_node

    @classmethod
    def from_env(cls) -> "Layout":
        """This process's run as torchrun (or accelerate launch, which runs torchrun) set it up."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        return cls(max(1, world // max(1, per_node)), per_node)

    def node_of(self, rank: int) -> int:
        """The node that runs global rank `rank`."""
        return rank // self.per_node

    def ranks_of(self, node: int) -> range:
        """The global ranks node `node` runs."""
        return range(node * self.per_node, (node + 1) * self.per_node)


def launch_line(layout: Layout, tail: list[str], endpoint: str = f"NODE0_HOST:{PORT}") -> str:
    """The command to run on every node (the same line on each; `endpoint` is a host every node
    reaches, usually the first node's): torchrun's c10d rendezvous numbers the nodes itself."""
    return shlex.join(["torchrun", f"--nnodes={layout.nodes}",
                       f"--nproc-per-node={layout.per_node}", "--rdzv-backend=c10d",
                       f"--rdzv-endpoint={endpoint}", "-m", "difftune", *tail])


def describe(layout: Layout, batch_size: int, grad_accum: int, lr: float,
             tail: list[str]) -> list[str]:
    """The lines `check --nodes N --processes-per-node G` prints: the layout, the global batch
    an optimizer step sees, why the learning rate is not scaled, and the launch line."""
    per_step = batch_size * layout.world * grad_accum
    local = f"0-{layout.per_node - 1}" if layout.per_node > 1 else "0"
    nodes = ", ".join(f"node {n}: ranks {r.start}-{r.stop - 1}" if len(r) > 1
                      else f"node {n}: rank {r.start}" for n in range(layout.nodes)
                      for r in [layout.ranks_of(n)])
    return [
        f"layout: {layout.nodes} node(s) x {layout.per_node} process(es) = {layout.world} "
        f"processes ({nodes}; local ranks {local} on each node)",
        f"  global batch: train.batch_size {batch_size} x {layout.world} processes x "
        f"train.grad_accum {grad_accum} = {per_step} images per optimizer step",
        f"  learning rate: train.lr {lr:g} per optimizer step, not scaled with the process "
        "count; a run resumes exactly on any layout with the same global batch (change "
        "train.batch_size with the process count to keep it)",
        f"  launch on every node: {launch_line(layout, tail)}",
    ]


def resume_line(layout: Layout, config: str, overrides: list[str]) -> str:
    """How to continue a multi-node run from its latest checkpoint."""
    tail = ["train", config] + [a for o in overrides for a in ("--set", o)]
    return (launch_line(layout, tail + ["--resume", "latest"])
            + " (on every node; any node count that keeps the global batch)")
