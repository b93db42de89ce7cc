"""`save.keep_best`: the measure that names the best checkpoint, as the user writes it.

An expression over logged metrics: one name (`"fidelity"`, `"val_loss"`) or a weighted
combination (`"0.7*fidelity + 0.3*clip_score/100"`): numbers, the names below, `+ - * /`,
unary minus and parentheses. It is parsed with Python's `ast` and evaluated by walking that
tree (never `eval`): anything else (a call, an attribute, a comparison) is refused when the
config loads, naming what was found.
"""

from __future__ import annotations

import ast
import operator
from typing import TYPE_CHECKING, Callable, Literal

if TYPE_CHECKING:
    from difftune.config.run import RunConfig

# Each metric a keep_best expression may name, and whether more is better.
HIGHER_IS_BETTER: dict[str, bool] = {
    "val_loss": False,            # the validation loss (train/validation.py)
    "fidelity": True,             # sample metrics (report/sample_metrics.py)
    "clip_score": True,
    "diversity": False,           # mean similarity among one prompt's seeds: lower is varied
    "nearest_similarity": False,  # closeness to one training image: lower copies less
}
SAMPLE_METRICS = frozenset(HIGHER_IS_BETTER) - {"val_loss"}
_OPS: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv}


class Measure:
    """A parsed keep_best expression: the names it reads, its direction, its value."""

    def __init__(self, text: str, mode: Literal["auto", "max", "min"] = "auto") -> None:
        try:
            self.tree = ast.parse(text.strip(), mode="eval").body
        except SyntaxError as err:
            raise ValueError(f"{text!r} is not an expression ({err.msg}); write e.g. "
                             "\"fidelity\" or \"0.7*fidelity + 0.3*clip_score/100\"") from None
        self.text = text.strip()
        self.names: set[str] = set()
        self._check(self.tree)
        self.higher = self._direction(mode)

    def _check(self, node: ast.AST) -> None:
        """Only numbers, known names and arithmetic (reported by what was found)."""
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            self._check(node.left)
            self._check(node.right)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            self._check(node.operand)
        elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
            pass
        elif isinstance(node, ast.Name):
            if node.id not in HIGHER_IS_BETTER:
                raise ValueError(f"unknown metric {node.id!r}; known: "
                                 f"{', '.join(sorted(HIGHER_IS_BETTER))}")
            self.names.add(node.id)
        else:
            raise ValueError(f"{ast.unparse(node)!r} is not allowed: write numbers, metric "
                             "names, + - * / and parentheses")

    def _direction(self, mode: str) -> bool:
        """Whether a larger value is better: the mode, or (auto) the metrics' own direction."""
        if mode != "auto":
            return mode == "max"
        ways = {HIGHER_IS_BETTER[n] for n in self.names}
        if len(ways) != 1:
            raise ValueError(f"{self.text!r} mixes metrics where higher is better with ones "
                             "where lower is; set save.keep_best_mode = \"max\" or \"min\"")
        return ways.pop()

    def value(self, figures: dict[str, float]) -> float:
        """The expression's value at one step's figures (every name present)."""
        return float(self._eval(self.tree, figures))

    def _eval(self, node: ast.AST, figures: dict[str, float]) -> float:
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](self._eval(node.left, figures),
                                       self._eval(node.right, figures))
        if isinstance(node, ast.UnaryOp):
            v = self._eval(node.operand, figures)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.Constant):
            return float(node.value)
        assert isinstance(node, ast.Name)
        return float(figures[node.id])

    def better(self, a: float, b: float | None) -> bool:
        """Whether score `a` beats `b` (anything beats no score)."""
        return b is None or (a > b if self.higher else a < b)


def keep_best_problems(cfg: "RunConfig") -> list[str]:
    """What a keep_best expression needs from the rest of the run, reported at load."""
    text = cfg.save.keep_best
    if text is None:
        return []
    names, problems = Measure(text, cfg.save.keep_best_mode).names, []
    if cfg.validation.keep_best:
        problems.append("validation.keep_best and save.keep_best both choose the best "
                        "checkpoint; keep one (validation.keep_best = true is save.keep_best "
                        "= \"val_loss\")")
    if "val_loss" in names and cfg.validation.enabled is False:
        problems.append(f"save.keep_best = {text!r} reads val_loss, but validation.enabled = "
                        "false; enable validation or choose by a sample metric")
    samples = sorted(names & SAMPLE_METRICS)
    if samples and not (cfg.metrics.enabled and cfg.sample.prompts is not None):
        problems.append(f"save.keep_best = {text!r} reads {', '.join(samples)}: set "
                        "metrics.enabled = true (with metrics.dino) and sample.prompts with "
                        "sample.every_n_steps")
    if "clip_score" in names and cfg.metrics.enabled and cfg.metrics.clip is None:
        problems.append(f"save.keep_best = {text!r} reads clip_score: set metrics.clip to a "
                        "local CLIP folder")
    return problems
