"""Qwen-Image 2.1's edit variant against QwenImage21Pipeline (CPU, exact): the caption read with
a reference image equals the pipeline's encoding and the modular text step's, the image slots
equal its `image_pad_mask`, `predict` with a reference is its transformer call, and samples
from embeddings (the subclass that supplies the mask __call__ takes no argument for) are the
images the pipeline makes from the prompt and the image itself."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from difftune import families
from difftune.data.images import load_control_pixels, load_rgb
from difftune.families.base import Conditioning
from difftune.families.qwen_image_21 import edit
from difftune.families.qwen_image_21.family import to_tokens
from difftune.families.qwen_image_21.tiny import build_tiny_qwen_image_21
from difftune.verbs.demo import demo_dir

from .conftest import cpu_policy

EDIT = demo_dir().parent / "edit"
PROMPTS = ["make the circle red", "", "a red circle on a blue background"]
SIZE = (64, 96)  # the reference's (width, height): 4 x 6 latent tokens, 2 x 3 image slots


@pytest.fixture(scope="module")
def setup() -> tuple[Any, Any, Any, Any]:
    """The pipeline over the tiny parts, the edit family, its components, and the reference
    (RGB, at SIZE) as the pipeline resizes it (RGBA)."""
    from diffusers import QwenImage21Pipeline

    parts = build_tiny_qwen_image_21("edit")
    pipe = QwenImage21Pipeline(**{k: parts[k] for k in ("transformer", "vae", "text_encoder",
                                                          "processor", "scheduler")})
    pipe.set_progress_bar_config(disable=True)
    family = families.get("qwen_image_21", "edit")
    comps = family.components({**parts, "name": "tiny", "fingerprint": "t"},
                              type("Cfg", (), {"name": None})(), cpu_policy())
    image = load_rgb(EDIT / "before/circle.png")
    resized = pipe.image_processor.resize(image.convert("RGBA"), width=SIZE[0], height=SIZE[1])
    return pipe, family, comps, resized


def _ours(family: Any, comps: Any, prompts: list[str]) -> Any:
    """The family's text entries for captions read with the reference at SIZE (the dataset
    path: `text_image_size` is the control size)."""
    from difftune.families.common.text import encode_with_images

    spec = family.spec.text_encoders[0]
    image = load_rgb(EDIT / "before/circle.png").resize(SIZE, 1)  # LANCZOS
    out = encode_with_images(spec, comps.text_encoders["qwen3vl"], comps.tokenizers["qwen3vl"],
                             prompts, [[image]] * len(prompts))
    return family.combine_text(comps, {"qwen3vl": out})


def test_text_and_image_slots_equal_the_pipelines_and_modular_step(
        setup: tuple[Any, Any, Any, Any]) -> None:
    """A left-padded batch (an empty caption among them) and each caption alone, read with the
    reference, equal the pipeline's `_get_qwen_prompt_embeds` and the modular text step's
    `get_qwenimage21_prompt_embeds` bit for bit; `edit.slots` at the family's offset is their
    `image_pad_mask` (2 x 3 slots for a 64 x 96 reference); the reference's latents are the
    pipeline's."""
    from diffusers.modular_pipelines.qwenimage21.encoders import get_qwenimage21_prompt_embeds

    pipe, family, comps, resized = setup
    want, want_mask, pads = pipe._get_qwen_prompt_embeds(list(PROMPTS), [resized], "cpu")
    modular = get_qwenimage21_prompt_embeds(pipe.text_encoder, pipe.processor, list(PROMPTS),
                                            [resized], "cpu")
    ours = _ours(family, comps, list(PROMPTS)).tensors
    for got, reference in ((ours["prompt_embeds"], want), (ours["prompt_embeds"], modular[0])):
        assert torch.equal(got, reference)
    assert torch.equal(ours["prompt_embeds_mask"].long(), want_mask.long())
    assert torch.equal(pads, modular[2]) and int(pads[0].sum()) == 6
    for row in pads:
        assert torch.equal(edit.slots(pads.shape[1], comps.extras["image_offset"], 6), row)
    for prompt in PROMPTS:
        one, _, _ = pipe._get_qwen_prompt_embeds([prompt], [resized], "cpu")
        assert torch.equal(_ours(family, comps, [prompt]).tensors["prompt_embeds"], one)
    vae = pipe.image_processor.preprocess(resized, width=SIZE[0], height=SIZE[1]).unsqueeze(2)
    latents = family.encode_images(comps, load_control_pixels(EDIT / "before/circle.png", SIZE))
    assert torch.equal(latents, pipe._encode_vae_image(vae, None)[:, :, 0])


def test_predict_with_a_reference_is_the_pipelines_transformer_call(
        setup: tuple[Any, Any, Any, Any]) -> None:
    """`predict` for two captions of different lengths with the reference is, row by row, the
    transformer called as QwenImage21Pipeline calls it: the reference's tokens before the
    target's, its `image_pad_mask` with the target's slots appended, the reference's and the
    target's shapes, the target's tokens of the output."""
    pipe, family, comps, resized = setup
    prompts = [PROMPTS[0], PROMPTS[2]]
    embeds = _ours(family, comps, prompts)
    reference = torch.randn(1, 64, SIZE[1] // 16, SIZE[0] // 16, generator=torch.Generator()
                            .manual_seed(1))
    noisy = torch.randn(2, 64, 4, 6, generator=torch.Generator().manual_seed(2))
    t = torch.tensor([0.8, 0.3])
    cond = Conditioning(guidance=1.0, original_sizes=[], crops=[], target_sizes=[],
                        controls=(reference.expand(2, -1, -1, -1),))
    # One intra-op thread: with two, the same sums split differently for the batch of two and
    # the pipeline's single rows (4.8e-7 apart); exactness is a claim about the computation.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _compare_rows(pipe, family, comps, prompts, embeds, reference, noisy, t, cond, resized)
    finally:
        torch.set_num_threads(threads)


def _compare_rows(pipe: Any, family: Any, comps: Any, prompts: list[str], embeds: Any,
                  reference: torch.Tensor, noisy: torch.Tensor, t: torch.Tensor,
                  cond: Conditioning, resized: Any) -> None:
    """Each row of `family.predict` equals the pipeline's transformer call for that row."""
    with torch.no_grad():
        ours = family.predict(comps, noisy, embeds, t, cond)
        for i, prompt in enumerate(prompts):
            text, _, pads = pipe._get_qwen_prompt_embeds([prompt], [resized], "cpu")
            mask = torch.cat([pads, pads.new_ones(1, 6)], dim=1)
            out = pipe.transformer(
                hidden_states=torch.cat([to_tokens(reference), to_tokens(noisy[i:i + 1])], 1),
                timestep=t[i:i + 1], encoder_hidden_states=text, img_mask=mask,
                img_shapes=[[(1, 6, 4), (1, 4, 6)]], return_dict=False)[0][:, -24:]
            assert torch.equal(to_tokens(ours[i:i + 1]), out)


def test_edit_samples_from_embeddings_as_the_pipeline_from_the_prompt(
        setup: tuple[Any, Any, Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """QwenImage21Pipeline refuses embeddings with `image` (no `image_pad_mask` argument: the
    gap `sampling.EmbeddedEditPipeline` fills); the family's pipeline with the embeddings of
    the caption read with the reference as `pipeline_text_images` sizes it gives the image
    QwenImage21Pipeline makes from the prompt and the reference, bit for bit, with true CFG."""
    pipe, family, comps, _ = setup
    monkeypatch.setattr(edit, "OUTPUT_RESOLUTION", 80)  # a 2:3 reference at 64 x 96
    image = load_rgb(EDIT / "before/circle.png").resize((40, 60))  # 2:3, resized to 64 x 96
    seen = family.pipeline_text_images([image])
    assert [i.size for i in seen] == [SIZE]
    from difftune.families.common.text import encode_with_images

    def embeds(prompt: str) -> Any:
        out = encode_with_images(family.spec.text_encoders[0], comps.text_encoders["qwen3vl"],
                                 comps.tokenizers["qwen3vl"], [prompt], [seen])
        return family.combine_text(comps, {"qwen3vl": out})

    kwargs = {**family.pipeline_inputs(embeds(PROMPTS[0]), embeds(""), 1.0, 4.0),
              **family.pipeline_images([image], 64, 64)}
    common = {"width": 64, "height": 64, "num_inference_steps": 3, "output_type": "np"}
    with pytest.raises(ValueError, match="image_pad_mask"):
        pipe(**kwargs, **common)
    ours = family.pipeline(comps)(**kwargs, **common, generator=torch.Generator().manual_seed(0))
    want = pipe(prompt=PROMPTS[0], negative_prompt="", true_cfg_scale=4.0, image=image,
                output_resolution=80, **common, generator=torch.Generator().manual_seed(0))
    assert np.array_equal(ours.images, want.images)


def test_references_the_processor_would_rescale_are_refused(
        setup: tuple[Any, Any, Any, Any], tmp_path: Any) -> None:
    """A folder's own image processor is read (its pixel bounds, saved nested in
    processor_config.json); a reference outside them, which Qwen3-VL would read at another
    size than the autoencoder (its slots then holding other tokens), is refused by `predict`
    and by the sampling pipeline, naming the bounds."""
    from transformers import Qwen2VLImageProcessorPil

    from difftune.families.qwen_image_21.files import image_processor

    pipe, family, comps, resized = setup
    pipe.processor.save_pretrained(str(tmp_path / "processor"))
    assert image_processor(tmp_path).size["longest_edge"] == 2048 * 2048
    narrow = Qwen2VLImageProcessorPil(patch_size=16)  # at most 1003520 pixels
    edit.check_size(512, 512, narrow)
    with pytest.raises(ValueError, match="1024x1024 reference is outside the processor's "
                                         "3136..1003520 pixels"):
        edit.check_size(1024, 1024, narrow)
    embeds = _ours(family, comps, [PROMPTS[0]])
    cond = Conditioning(guidance=1.0, original_sizes=[], crops=[], target_sizes=[],
                        controls=(torch.zeros(1, 64, 1, 2),))  # 32 x 16 pixels
    with pytest.raises(ValueError, match="32x16 reference is outside the processor's 1024"):
        family.predict(comps, torch.zeros(1, 64, 2, 2), embeds, torch.ones(1), cond)
