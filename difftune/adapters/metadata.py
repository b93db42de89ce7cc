"""The metadata other tools read from a LoRA or embedding file.

Model sites, model managers and UIs (A1111/Forge, ComfyUI managers, Civitai) show and filter
files by two conventions: kohya sd-scripts' `ss_*` keys (train_network.py writes them) and
Stability's model spec (`modelspec.*`, as kohya's library/sai_model_spec.py writes it). Values
are what the file really holds: `ss_network_alpha` is the alpha its tensors are to be read with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from difftune.adapters.kinds import kind
from difftune.families.base import ModelSpec

if TYPE_CHECKING:
    from difftune.config.adapter import AdapterConfig

SAI_MODEL_SPEC = "1.0.0"  # the model-spec version these keys follow
LORA, TEXTUAL_INVERSION = "lora", "textual-inversion"  # model-spec adapter suffixes
# kohya's model-spec implementation for textual-inversion files, whatever the base model.
TI_IMPLEMENTATION = "https://github.com/Stability-AI/generative-models"


@dataclass(frozen=True)
class FileFacts:
    """What a run knows about a file it writes: its name, size, training length."""

    title: str  # save.name (kohya: the output name, also its default model-spec title)
    resolution: int  # training resolution (square side)
    steps: int  # optimizer steps the weights have seen
    max_steps: int  # train.steps


def now_iso() -> str:
    """The current time, ISO-8601 to the second with its UTC offset (modelspec.date)."""
    return datetime.now(timezone.utc).astimezone().replace(microsecond=0).isoformat()


def model_spec_keys(spec: ModelSpec, adapter: str, title: str, resolution: int,
                    implementation: str | None = None) -> dict[str, str]:
    """The `modelspec.*` keys of an adapter file (`adapter`: LORA or TEXTUAL_INVERSION)."""
    return {
        "modelspec.sai_model_spec": SAI_MODEL_SPEC,
        "modelspec.architecture": f"{spec.architecture}/{adapter}",
        "modelspec.implementation": implementation or spec.implementation,
        "modelspec.title": title,
        "modelspec.date": now_iso(),
        "modelspec.resolution": f"{resolution}x{resolution}",
    }


def lora_keys(spec: ModelSpec, facts: FileFacts, rank: int, alpha: float) -> dict[str, str]:
    """kohya's `ss_*` keys and the model-spec keys of a LoRA file.

    `rank` and `alpha` are the file's: a LoRA whose scale was folded into its up factors is
    read with alpha = rank, and says so.
    """
    return {
        "ss_network_module": spec.network_module,
        "ss_network_dim": str(int(rank)),
        "ss_network_alpha": str(float(alpha)),
        "ss_base_model_version": spec.base_version,
        "ss_output_name": facts.title,
        "ss_resolution": f"({facts.resolution}, {facts.resolution})",
        "ss_steps": str(facts.steps),
        "ss_max_train_steps": str(facts.max_steps),
    } | model_spec_keys(spec, LORA, facts.title, facts.resolution)


def lycoris_keys(adapter: "AdapterConfig") -> dict[str, str]:
    """What a LyCORIS-layout file says it is: LyCORIS's kohya network module and its
    `ss_network_args` (algo, factor, conv dim...) as LyCORIS and the model sites read them, and
    difftune's own kind (what `--init-lora` checks a file against)."""
    args: dict[str, object] = {"algo": kind(adapter.type).algo}
    if adapter.dora:
        args["dora_wd"] = True
    if adapter.type == "lokr":
        args |= {"factor": adapter.factor, "decompose_both": adapter.decompose_both,
                 "full_matrix": adapter.full_matrix}
    if adapter.conv_rank is not None:
        args |= {"conv_dim": adapter.conv_rank,
                 "conv_alpha": adapter.conv_alpha or float(adapter.conv_rank)}
    return {"ss_network_module": "lycoris.kohya", "ss_network_args": json.dumps(args),
            "difftune.adapter": adapter.type, "difftune.dora": str(adapter.dora).lower()}


def embedding_keys(spec: ModelSpec, placeholder: str, resolution: int) -> dict[str, str]:
    """The model-spec keys of a textual-inversion file, titled by its placeholder."""
    return model_spec_keys(spec, TEXTUAL_INVERSION, placeholder, resolution, TI_IMPLEMENTATION)
