"""A translation in progress: the difftune run mapping being built and one note per source key.

Each trainer's reader walks its file key by key through a table of rules (`To`, `Drop`, or a
function for keys that need more than a rename), so the reader is mostly data and every key
of the source ends up in exactly one note: mapped, guessed, built in, no equivalent, unknown.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Union

Kind = Literal["maps", "guessed", "built in", "no equivalent", "unknown"]


class NoEquivalent(Exception):
    """Raised by a value converter: this value (not the key) has no difftune counterpart."""


@dataclass(frozen=True)
class To:
    """The source key becomes difftune key `dst` (dotted; list indices as numbers), its value
    passed through `convert` (which may raise NoEquivalent); `guess` marks the mapping as a
    guess and says why."""

    dst: str
    convert: Callable[[Any], Any] | None = None
    guess: str | None = None


@dataclass(frozen=True)
class Drop:
    """The source key has nothing to set in difftune: `why` says what difftune does instead;
    `builtin` when difftune already does what the key asks (nothing is lost). An empty `why`:
    the key is read with another one, whose note covers it (USED)."""

    why: str
    builtin: bool = False


@dataclass(frozen=True)
class Note:
    """One line of the import report: a source key, what became of it, and why."""

    kind: Kind
    source: str
    target: str = ""
    why: str = ""


USED = Drop("")

# A rule: a plain rename, a drop, or a function given (translation, key, value, where) for
# keys whose meaning needs more than one difftune field.
Handler = Callable[["Translation", str, Any, str], None]
Rule = Union[To, Drop, Handler]


def show(value: Any) -> str:
    """A value as the report and comments show it (TOML-like, short)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def src(key: str, value: Any) -> str:
    """A source key and its value as the report shows them."""
    return f"{key} = {show(value)}"


def place(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `dotted` (e.g. "datasets.0.subsets.1.path") in `data`, creating tables and list
    entries on the way."""
    parts = dotted.split(".")
    node: Any = data
    for part, after in zip(parts[:-1], parts[1:]):
        key: Any = int(part) if isinstance(node, list) else part
        if isinstance(node, list):
            while len(node) <= key:
                node.append({})
        elif key not in node:
            node[key] = [] if after.isdigit() else {}
        node = node[key]
    node[parts[-1]] = value


@dataclass
class Translation:
    """A run mapping under construction, its notes, the comment of each key written, and the
    prompt file to write beside it (from the source's inline prompts)."""

    trainer: str
    base: Path = field(default_factory=Path)  # the source file's folder (relative paths)
    data: dict[str, Any] = field(default_factory=dict)
    notes: list[Note] = field(default_factory=list)
    comments: dict[str, str] = field(default_factory=dict)
    prompts: list[str] = field(default_factory=list)  # lines of a prompt file to write
    prompt_file: str = "prompts.txt"  # its name, beside the run file
    context: dict[str, Any] = field(default_factory=dict)  # a reader's own state
    defaulted: set[str] = field(default_factory=set)  # keys filled from the trainer's defaults

    def put(self, dst: str, value: Any, source: str, guess: str | None = None) -> None:
        """Set difftune key `dst` from `source` (the report's left side); a guess says why.
        An unset value (None, as JSON's null) sets nothing."""
        if value is None:
            self.drop(source, "unset in the file", builtin=True)
            return
        place(self.data, dst, value)
        kind: Kind = "guessed" if guess else "maps"
        self.notes.append(Note(kind, source, f"{dst} = {show(value)}", guess or ""))
        self.comments[dst] = f"guessed: {guess}" if guess else f"{self.trainer}: {source}"

    def drop(self, source: str, why: str, builtin: bool = False) -> None:
        """Note a source key that sets nothing here, and why."""
        self.notes.append(Note("built in" if builtin else "no equivalent", source, "", why))

    def unknown(self, source: str) -> None:
        """Note a key this importer does not know (left out)."""
        self.notes.append(Note("unknown", source, "", "not a key this importer knows; left out"))

    def apply(self, table: dict[str, Rule], mapping: dict[str, Any], where: str = "",
              prefix: str = "") -> None:
        """Translate each key of `mapping` by its rule in `table`; `where` replaces `{}` in the
        rules' destinations (e.g. a dataset's index); `prefix` names the source table."""
        for key, value in mapping.items():
            self.rule(table.get(key), prefix + key, value, where)

    def rule(self, rule: Rule | None, key: str, value: Any, where: str = "") -> None:
        """Apply one rule to one source key."""
        if key in self.defaulted:
            key = f"{key} ({self.trainer}'s default, not in the file)"
        source = src(key, value)
        if rule is None:
            self.unknown(source)
        elif isinstance(rule, Drop) and rule.why:
            self.drop(source, rule.why, rule.builtin)
        elif isinstance(rule, Drop):
            return  # read together with another key, whose note says what became of it
        elif isinstance(rule, To):
            try:
                converted = rule.convert(value) if rule.convert else value
            except NoEquivalent as err:
                self.drop(source, str(err))
                return
            self.put(rule.dst.replace("{}", where), converted, source, rule.guess)
        else:
            rule(self, key, value, where)

    def fill(self, mapping: dict[str, Any], defaults: dict[str, Any], prefix: str = "") -> None:
        """Give `mapping` the trainer's own defaults for the keys it lacks, where they differ
        from difftune's (a LoRA alpha of 1, a small learning rate), so the run trains as the
        other trainer would have; each is marked in the report."""
        for key, value in defaults.items():
            if key not in mapping:
                mapping[key] = value
                self.defaulted.add(prefix + key)

    def get(self, dotted: str, default: Any = None) -> Any:
        """The value already set at `dotted`, or `default`."""
        node: Any = self.data
        for part in dotted.split("."):
            try:
                node = node[int(part)] if isinstance(node, list) else node[part]
            except (KeyError, IndexError, ValueError):
                return default
        return node
