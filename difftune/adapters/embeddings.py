"""Textual inversion: new placeholder tokens learned as input or output embeddings.

A placeholder (`<sks>`, N vectors) becomes N new tokens (`<sks>_0 ... <sks>_N-1`) in the
tokenizer of each text encoder that learns it, and captions are expanded to them for that
encoder only. Input embeddings: the token-embedding table is wrapped (`set_input_embeddings`,
transformers' public API) so the new ids read a trainable fp32 table while every existing row
stays frozen: only the new rows train. Output embeddings: trainable vectors replace the
encoder's output at the placeholder positions.

Initialization runs under the run's precision policy (the encoder in its dtype, the result
cast to fp32 for training), so fp16 / fp8 text encoders initialize like they train.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch

from difftune.config import EmbeddingConfig
from difftune.families.base import Components, Family
from difftune.families.common import text

log = logging.getLogger("difftune")


class ExtendedEmbedding(torch.nn.Module):
    """A frozen embedding table plus new rows for ids from `offset` on.

    The new rows train, except those marked in `fixed` (the input rows of output-embedding
    placeholders, which only mark their positions): those get no gradient.
    """

    def __init__(self, base: torch.nn.Embedding, rows: torch.nn.Parameter, offset: int,
                 fixed: torch.Tensor) -> None:
        super().__init__()
        self.base, self.rows, self.offset = base, rows, offset
        self.register_buffer("fixed", fixed, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The base table (what callers that read `.weight` for its dtype/shape expect)."""
        return self.base.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Base rows for known ids, the trainable rows (cast to the table's dtype) for new ones."""
        new = ids >= self.offset
        out = self.base(ids.clamp(max=self.offset - 1))
        if bool(new.any()):
            rows = torch.where(self.fixed.unsqueeze(-1), self.rows.detach(), self.rows)
            extra = rows.to(out.dtype)[(ids - self.offset).clamp(min=0)]
            out = torch.where(new.unsqueeze(-1), extra, out)
        return out


@dataclass
class Learned:
    """One placeholder in one encoder: its token ids, and for output embeddings its trainable
    vectors (input embeddings live in the encoder's extended table, see `tensor_of`)."""

    spec: EmbeddingConfig
    encoder: str
    ids: list[int]
    vectors: torch.nn.Parameter | None

    @property
    def key(self) -> str:
        """Canonical name (checkpoints, optimizer state)."""
        return f"emb.{self.spec.name}.{self.encoder}.{self.spec.kind}"


class Embeddings:
    """Every learned placeholder of a run, installed into the text encoders."""

    def __init__(self, specs: list[EmbeddingConfig], family: Family, comps: Components) -> None:
        self.family, self.comps = family, comps
        self.specs = {s.name: s for s in family.text_encoders}
        self.learned: list[Learned] = []
        for spec in specs:
            for name in spec.encoders or [s.name for s in family.text_encoders]:
                self.learned.append(self._install(spec, name))

    def _install(self, spec: EmbeddingConfig, name: str) -> Learned:
        # Output embeddings in a pooled-only encoder are refused when the config loads
        # (config.checks, from the family's spec).
        model = self.comps.text_encoders[name]
        table = model.get_input_embeddings()
        if not isinstance(table, ExtendedEmbedding):  # first placeholder here: a private copy,
            # since tokenizers may be shared (cached) between loads and this adds tokens
            self.comps.tokenizers[name] = copy.deepcopy(self.comps.tokenizers[name])
        tok = self.comps.tokenizers[name]
        self._check_pooling(name, model, tok, spec)
        base = table.base if isinstance(table, ExtendedEmbedding) else table
        offset = table.offset if isinstance(table, ExtendedEmbedding) else len(tok)
        new_tokens = [f"{spec.name}_{i}" for i in range(spec.tokens)]
        tok.add_tokens(new_tokens)
        ids = tok.convert_tokens_to_ids(new_tokens)
        init_ids = tok(spec.init, add_special_tokens=False)["input_ids"] or [0]
        pick = torch.arange(spec.tokens) % len(init_ids)
        with torch.no_grad():
            seed = base.weight[torch.tensor(init_ids, device=base.weight.device)].float()[pick]
            output = self._init_output(name, spec.init, len(init_ids))[pick] \
                if spec.kind == "output" else None
        self._extend(model, base, offset, ids, seed, fixed=spec.kind == "output")
        vectors = None if output is None else \
            torch.nn.Parameter(output.clone().to(text.module_device(model)))
        log.info("placeholder %s: %d %s vector(s) in %s, from %r", spec.name, spec.tokens,
                 spec.kind, name, spec.init)
        return Learned(spec, name, ids, vectors)

    def _check_pooling(self, name: str, model: torch.nn.Module, tok: object,
                       spec: EmbeddingConfig) -> None:
        """Warn when old CLIP configs (eos_token_id = 2) would pool at the placeholder:
        transformers then pools at the highest token id, which an added token is."""
        eos = getattr(model.config, "eos_token_id", None)
        if self.specs[name].pooled and eos is not None and eos != tok.eos_token_id:
            log.warning("%s: its config's eos_token_id (%s) is not its tokenizer's (%s), so "
                        "transformers pools it at the highest token id: for captions with %s, "
                        "the placeholder. Set eos_token_id to %s in the text encoder's "
                        "config.json", name, eos, tok.eos_token_id, spec.name, tok.eos_token_id)

    @staticmethod
    def _extend(model: torch.nn.Module, base: torch.nn.Embedding, offset: int, ids: list[int],
                seed: torch.Tensor, fixed: bool) -> None:
        """Install (or grow) the model's ExtendedEmbedding with rows for `ids` set to `seed`."""
        table = model.get_input_embeddings()
        count = max(ids) + 1 - offset
        rows = torch.zeros(count, base.embedding_dim, device=base.weight.device)
        mask = torch.zeros(count, dtype=torch.bool, device=base.weight.device)
        if isinstance(table, ExtendedEmbedding):
            rows[: len(table.rows)], mask[: len(table.fixed)] = table.rows.data, table.fixed
        rows[[i - offset for i in ids]] = seed.to(rows.device)
        mask[[i - offset for i in ids]] = fixed
        param = torch.nn.Parameter(rows, requires_grad=not bool(mask.all()))
        model.set_input_embeddings(ExtendedEmbedding(base, param, offset, mask))

    def _init_output(self, name: str, init: str, count: int) -> torch.Tensor:
        """The encoder's own output for the init text, at its tokens (under the run's dtype)."""
        spec = self.specs[name]
        length = text.max_length(spec, self.comps.extras)
        out = text.encode(spec, self.comps.text_encoders[name], self.comps.tokenizers[name],
                          [init], length)
        hidden = out["hidden"][0].float()
        return hidden[1 : 1 + count] if spec.is_clip else hidden[:count]

    def parameters(self) -> dict[str, torch.nn.Parameter]:
        """Trainable tensors by canonical name (one input table per encoder holds all rows)."""
        return {self.tensor_name(item): self.tensor_of(item) for item in self.learned}

    @staticmethod
    def tensor_name(item: Learned) -> str:
        """The canonical name of the tensor that trains `item` (input rows: one per encoder)."""
        return item.key if item.spec.kind == "output" else f"emb.{item.encoder}.input_rows"

    def tensor_of(self, item: Learned) -> torch.nn.Parameter:
        """The trainable tensor holding `item`'s vectors (for input ones, the encoder's rows)."""
        if item.vectors is not None:
            return item.vectors
        return self.comps.text_encoders[item.encoder].get_input_embeddings().rows

    def encoders(self) -> set[str]:
        """The text encoders that learn something (they run live on captions that use it)."""
        return {item.encoder for item in self.learned}

    def expand(self, name: str, caption: str) -> str:
        """The caption as encoder `name` reads it: each placeholder spelled as its tokens."""
        for item in self.learned:
            if item.encoder == name and item.spec.name in caption:
                tokens = " ".join(f"{item.spec.name}_{i}" for i in range(item.spec.tokens))
                caption = caption.replace(item.spec.name, tokens)
        return caption

    def uses(self, name: str, captions: list[str]) -> bool:
        """Whether encoder `name` learns a placeholder that one of the captions contains."""
        return any(item.encoder == name and item.spec.name in c
                   for item in self.learned for c in captions)

    def replace_outputs(self, name: str, ids: torch.Tensor, out: dict[str, torch.Tensor]
                        ) -> dict[str, torch.Tensor]:
        """Output embeddings: the hidden states at placeholder positions become the vectors."""
        hidden = out.get("hidden")
        for item in self.learned:
            if item.encoder != name or item.spec.kind != "output" or hidden is None:
                continue
            for j, token in enumerate(item.ids):
                where = (ids == token).to(hidden.device).unsqueeze(-1)
                vec = item.vectors[j].to(hidden.dtype).expand_as(hidden)
                hidden = torch.where(where, vec, hidden)
        return {**out, "hidden": hidden} if hidden is not None else out

    def file_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per placeholder, its vectors per encoder as UIs read them ({"clip_l": N x D, ...};
        output embeddings as "<encoder>_output")."""
        files: dict[str, dict[str, torch.Tensor]] = {}
        for item in self.learned:
            key = item.encoder if item.spec.kind == "input" else f"{item.encoder}_output"
            files.setdefault(item.spec.name, {})[key] = self.vectors_of(item)
        return files

    def vectors_of(self, item: Learned) -> torch.Tensor:
        """The N vectors of one learned placeholder (fp32, CPU)."""
        if item.spec.kind == "output":
            return item.vectors.detach().float().cpu()
        table = self.comps.text_encoders[item.encoder].get_input_embeddings()
        return table.rows.detach()[[i - table.offset for i in item.ids]].float().cpu()

    def load_vectors(self, files: dict[str, dict[str, torch.Tensor]]) -> int:
        """Set vectors from `file_tensors`-shaped data (a file or a LoRA's bundle); returns count."""
        count = 0
        with torch.no_grad():
            for item in self.learned:
                key = item.encoder if item.spec.kind == "input" else f"{item.encoder}_output"
                value = files.get(item.spec.name, {}).get(key)
                if value is None:
                    continue
                if item.spec.kind == "output":
                    item.vectors.copy_(value)
                else:
                    table = self.comps.text_encoders[item.encoder].get_input_embeddings()
                    table.rows[[i - table.offset for i in item.ids]] = value.to(table.rows)
                count += 1
        return count
