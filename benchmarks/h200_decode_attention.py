"""Decode attention alone, as the engine's CUDA graphs run it: Llama-3-8B's GQA (triton_flash) and
DeepSeek-V2-Lite's MLA (triton_mla) over batch x context x split count x launch configuration.

    python benchmarks/h200_decode_attention.py [--out FILE.json] [--quick] [--fp8 [--fp8-words]] [--only flash|mla]
        [--shapes 256x192,...] [--mla-prefill]
    python benchmarks/h200_decode_attention.py --best-fp8 FILE.json   # the fastest fp8 launch in it (fp8-attn-ab)

The graphs are captured with max_seq_len = max_model_len (4096 here), so the split count a batch size
gets is fixed at capture while real contexts are often far shorter; this sweep times the kernels in
that situation (metadata max_seq_len 4096, every request's context `ctx`), as graph replays (no Python
launch gaps), and reports ms per layer and the fraction of measured copy bandwidth the cached K/V (or
latent) bytes represent. `default` is the split count the engine would choose. --fp8: over an e4m3 cache
(kv_cache_dtype fp8, scales != 1 folded out of the tiles), its bytes (half of bf16's) in the fraction;
--fp8-words also times each backend reading that cache as int32 words (`decode_fp8_words`) beside bytes, and
triton_flash's words without the next tile loaded ahead (`decode_words_ahead=False`, rows "fp8_words": "inline").
--mla-prefill: MLA's causal prefill tiles alone (DeepSeek-V2-Lite's 16 heads; prompts x length, as the
throughput harness's 8192-token steps of 128-token prompts) per (heads, query tokens, key tile, warps, stages)
of a program, with their TFLOPS (the absorbed form's 2 * (576 + 512) FLOPs per visible query-key pair and head).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from h200_llama8b import _events_ms
from h200_moe_tiles import copy_bandwidth_GBps

CAPTURE_MAX_SEQ = 4096
BLOCK = 16
FP8_SCALES = (0.05, 0.02)  # (k_scale, v_scale) of --fp8; MLA's latent takes k_scale


def common_md(batch: int, ctx: int):
    from keel.attention.metadata import CommonAttentionMetadata

    blocks_per = -(-(ctx + 1) // BLOCK)
    num_blocks = batch * blocks_per + 1
    perm = torch.randperm(num_blocks - 1, device="cuda").to(torch.int32) + 1
    table = torch.zeros(batch, CAPTURE_MAX_SEQ // BLOCK, dtype=torch.int32, device="cuda")
    table[:, :blocks_per] = perm.view(batch, blocks_per)
    seq = torch.full((batch,), ctx + 1, dtype=torch.int32)
    pos = seq.long() - 1
    slots = table.long().cpu()[torch.arange(batch), pos // BLOCK] * BLOCK + pos % BLOCK
    common = CommonAttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        query_start_loc_cpu=torch.arange(batch + 1, dtype=torch.int32), seq_lens=seq.cuda(), seq_lens_cpu=seq,
        block_table=table, slot_mapping=slots.cuda(), num_reqs=batch, num_actual_tokens=batch, max_query_len=1,
        max_seq_len=CAPTURE_MAX_SEQ, block_size=BLOCK)
    return common, num_blocks


def graph_ms(fn) -> float:
    for _ in range(2):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return _events_ms(g.replay, iters=50, warmup=5)


def cache_and_scales(shape: tuple[int, ...], fp8: bool) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                   torch.Tensor | None]:
    """A random bf16 cache, or an e4m3 one holding those values quantized, and its (k_scale, v_scale)."""
    from keel.layers.fp8_utils import FP8
    from keel.layers.kv_scales import quantize_kv

    cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    if not fp8:
        return cache, None, None
    k_scale, v_scale = (torch.tensor([s], device="cuda") for s in FP8_SCALES)
    return quantize_kv(cache, k_scale, FP8), k_scale, v_scale  # timing only: one scale for K and V


def flash_launch(launch) -> tuple[tuple[int, int, int] | None, bool | None]:
    """A triton_flash launch of this script, (tile, warps, stages) or with a fourth element True (block numbers
    loaded a tile ahead), or None (the engine's: launch and block numbers as the engine picks them) ->
    (decode_launch, decode_blocks_ahead)."""
    if launch is None:
        return None, None
    return tuple(launch[:3]), len(launch) == 4 and bool(launch[3])


def flash_case(batch: int, ctx: int, splits, launch, fp8: bool = False, fp8_words: bool | None = None,
               words_ahead: bool = True) -> float:
    """`launch`: see `flash_launch`."""
    launch, blocks_ahead = flash_launch(launch)
    from keel_attention_flash.backend import TritonFlashAttentionBackend
    from keel_attention_flash.impl import TritonFlashAttentionImpl

    from keel.attention.backend import AttentionLayerConfig

    h, hkv, d = 32, 8, 128
    common, num_blocks = common_md(batch, ctx)
    cache, k_scale, v_scale = cache_and_scales((2, num_blocks, BLOCK, hkv, d), fp8)
    md = TritonFlashAttentionBackend.get_metadata_builder(torch.device("cuda")).build(common)
    q = torch.randn(batch, h, d, dtype=torch.bfloat16, device="cuda")
    k, v = torch.randn(batch, hkv, d, dtype=torch.bfloat16, device="cuda"), torch.randn(
        batch, hkv, d, dtype=torch.bfloat16, device="cuda")
    impl = TritonFlashAttentionImpl(AttentionLayerConfig(h, hkv, d, d**-0.5, torch.bfloat16, BLOCK,
                                                         kv_cache_dtype=cache.dtype if fp8 else None),
                                    decode_splits=splits, decode_launch=launch, decode_fp8_words=fp8_words,
                                    decode_words_ahead=words_ahead, decode_blocks_ahead=blocks_ahead)
    if fp8:
        impl.set_kv_scales(k_scale, v_scale)
    return graph_ms(lambda: impl.forward(q, k, v, cache, md))


H, N, R, V, L = 16, 128, 64, 128, 512  # DeepSeek-V2-Lite's MLA: heads, nope, rope, value dims, latent


def mla_impl(num_blocks: int, fp8: bool, **launch):
    """(TritonMLAImpl of DeepSeek-V2-Lite's MLA layer with `launch`'s tuning arguments, its random latent cache)."""
    from keel_attention_flash.mla_impl import TritonMLAImpl

    from keel.attention.backend import AttentionLayerConfig

    cache, k_scale, _ = cache_and_scales((num_blocks, BLOCK, L + R), fp8)
    layer = AttentionLayerConfig(
        num_heads=H, num_kv_heads=1, head_size=L + R, scale=(N + R) ** -0.5, dtype=torch.bfloat16,
        block_size=BLOCK, use_mla=True, kv_cache_dtype=cache.dtype if fp8 else None,
        extra=(("kv_lora_rank", L), ("qk_nope_head_dim", N), ("qk_rope_head_dim", R), ("v_head_dim", V)))
    impl = TritonMLAImpl(layer, **launch)
    if fp8:
        impl.set_kv_scales(k_scale, k_scale)
    return impl, cache


def mla_case(batch: int, ctx: int, splits, launch, fp8: bool = False, fp8_words: bool | None = None) -> float:
    """`launch`: (heads, key tile, warps, stages), a fifth element True: block numbers loaded a tile ahead; None: the
    engine's."""
    from keel_attention_flash.mla_backend import TritonMLABackend

    ahead = None if launch is None else len(launch) == 5 and bool(launch[4])  # None: as the engine picks it
    launch = None if launch is None else tuple(launch[:4])
    common, num_blocks = common_md(batch, ctx)
    impl, cache = mla_impl(num_blocks, fp8, decode_splits=splits, decode_launch=launch, decode_fp8_words=fp8_words,
                           decode_blocks_ahead=ahead)
    impl.process_weights_after_loading(torch.randn(H, N, L, dtype=torch.bfloat16, device="cuda") / L**0.5,
                                       torch.randn(H, V, L, dtype=torch.bfloat16, device="cuda") / L**0.5)
    md = TritonMLABackend.get_metadata_builder(torch.device("cuda")).build(common)
    q = torch.randn(batch, H, N + R, dtype=torch.bfloat16, device="cuda")
    kv_c = torch.randn(batch, L, dtype=torch.bfloat16, device="cuda")
    k_pe = torch.randn(batch, R, dtype=torch.bfloat16, device="cuda")
    return graph_ms(lambda: impl.forward(q[..., :N], q[..., N:], kv_c, k_pe, cache, md))


# (heads, query tokens, key tile, warps, stages) of one prefill program; None: the engine's default.
MLA_PREFILL_LAUNCHES = [None, (16, 2, 32, 4, 2), (16, 2, 64, 4, 2), (16, 2, 32, 4, 3), (16, 4, 32, 8, 2),
                        (16, 4, 64, 8, 2), (16, 4, 32, 8, 3), (16, 4, 16, 8, 3), (16, 1, 32, 4, 2), (16, 2, 16, 4, 3),
                        (8, 4, 32, 4, 2), (16, 8, 32, 8, 2)]


def mla_prefill_case(prompts: int, length: int, launch, fp8: bool = False) -> float:
    """ms of MLA's prefill tiles alone over `prompts` causal prompts of `length` tokens (no cached context)."""
    from keel_attention_flash.mla_backend import TritonMLABackend

    from keel.attention.metadata import CommonAttentionMetadata

    blocks_per = -(-length // BLOCK)
    num_blocks = prompts * blocks_per + 1
    table = (torch.randperm(num_blocks - 1, device="cuda").to(torch.int32) + 1).view(prompts, blocks_per)
    qsl = torch.arange(0, prompts * length + 1, length, dtype=torch.int32)
    seq = torch.full((prompts,), length, dtype=torch.int32)
    pos = torch.arange(length).repeat(prompts)
    slots = table.long().cpu()[torch.arange(prompts).repeat_interleave(length), pos // BLOCK] * BLOCK + pos % BLOCK
    common = CommonAttentionMetadata(
        query_start_loc=qsl.cuda(), query_start_loc_cpu=qsl, seq_lens=seq.cuda(), seq_lens_cpu=seq,
        block_table=table, slot_mapping=slots.cuda(), num_reqs=prompts, num_actual_tokens=prompts * length,
        max_query_len=length, max_seq_len=CAPTURE_MAX_SEQ, block_size=BLOCK)
    impl, cache = mla_impl(num_blocks, fp8, prefill_launch=launch)
    md = TritonMLABackend.get_metadata_builder(torch.device("cuda")).build(common)
    t = prompts * length
    q_c = torch.randn(t, H, L, dtype=torch.bfloat16, device="cuda") / 8
    q_pe = torch.randn(t, H, R, dtype=torch.bfloat16, device="cuda")
    o_latent = torch.empty(t, H, L, dtype=torch.bfloat16, device="cuda")
    return _events_ms(lambda: impl._prefill(q_c, q_pe, cache, md, o_latent), iters=20, warmup=3)


def best_fp8_launch(path: str, batch: int = 1024) -> str:
    """The fastest one-split triton_flash row at `batch` requests of a --fp8-words result file that reads the fp8
    cache as bytes or as words loaded where attended: "bytes|inline TILE, WARPS, STAGES BLOCKS_AHEAD" (0 / 1).
    Its row and the engine's default's go to stderr. The fp8-attn-ab part of h200_run.sh sets the impl's
    constants to it."""
    from keel_attention_flash.impl import _BATCH_LAUNCH_FP8_MANY, _BLOCKS_AHEAD, _FP8_WORDS

    rows = [r for r in json.loads(Path(path).read_text())["rows"]
            if r["kind"] == "flash" and r["batch"] == batch and "us" in r and r["splits"] in (None, 1)]
    rows = [r for r in rows if r.get("fp8_words") in (None, False, "inline")]
    if not rows:
        raise SystemExit(f"no one-split bytes / inline-words row at batch {batch} in {path}")
    best = min(rows, key=lambda r: r["us"])
    default = next((r["us"] for r in rows if r["launch"] is None and r["splits"] is None and "fp8_words" not in r),
                   None)
    print(f"fastest {best} (the engine's default {default} us)", file=sys.stderr)
    launch, ahead = flash_launch(best["launch"])
    tile, warps, stages = launch or _BATCH_LAUNCH_FP8_MANY  # the engine's launch at 1024 requests (8,192 programs)
    ahead = _BLOCKS_AHEAD if ahead is None else ahead
    words = best.get("fp8_words")  # absent: the engine's (inline words past 4,096 programs, where _FP8_WORDS)
    mode = "inline" if words == "inline" or (words is None and _FP8_WORDS) else "bytes"
    return f"{mode} {tile}, {warps}, {stages} {int(ahead)}"


def _launch(text: str) -> tuple:
    """'64x4x3b' -> (64, 4, 3, True): a trailing b, block numbers loaded a tile ahead (a last element True)."""
    return tuple(int(v) for v in text.rstrip("b").split("x")) + ((True,) if text.endswith("b") else ())


def main() -> None:
    if sys.argv[1:2] == ["--best-fp8"]:  # h200_run.sh's fp8-attn-ab
        print(best_fp8_launch(sys.argv[2]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="an e4m3 KV cache (kv_cache_dtype fp8)")
    ap.add_argument("--only", choices=("flash", "mla"), default=None, help="decode sweep of one backend only")
    ap.add_argument("--shapes", default="", help="decode (batch x context) pairs, e.g. 256x192,256x640")
    ap.add_argument("--flash-launches", default="", metavar="NxWxS,...",
                    help="triton_flash's launches (key tile x warps x stages, a trailing b: block numbers loaded "
                         "a tile ahead) instead of the list here; the engine's default is always timed too")
    ap.add_argument("--mla-launches", default="", metavar="HxNxWxS,...",
                    help="triton_mla's decode launches (heads x key tile x warps x stages, a trailing b: block "
                         "numbers loaded a tile ahead) instead of the list here; the engine's default is timed too")
    ap.add_argument("--fp8-words", action="store_true",
                    help="with --fp8: each case with the cache read as bytes and as int32 words (fp8_words)")
    ap.add_argument("--mla-prefill", nargs="*", default=None, metavar="PROMPTSxLEN",
                    type=lambda v: tuple(int(x) for x in v.split("x")),
                    help="only MLA's prefill tiles, e.g. 64x128 16x512 (no decode sweep)")
    a = ap.parse_args()
    bw = copy_bandwidth_GBps()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)

    def save(rows: list) -> None:
        if a.out:
            Path(a.out).write_text(json.dumps({"copy_bw_GBps": bw, "device": torch.cuda.get_device_name(),
                                               "torch": torch.__version__, "fp8": a.fp8, "rows": rows}, indent=1))
    shapes = [(256, 192), (256, 640), (64, 192), (64, 1024), (1, 192), (1, 2048)]
    split_opts = [None, 1, 2, 4, 8, 16]
    flash_launches = [None, (64, 4, 1), (32, 4, 2), (32, 2, 2), (64, 2, 2), (128, 4, 1), (16, 2, 2), (64, 8, 2),
                      (32, 2, 1), (32, 4, 1), (64, 2, 1), (16, 2, 1)]
    mla_launches = [None, (16, 32, 4, 2), (16, 16, 4, 2), (16, 64, 8, 1), (16, 32, 8, 1), (16, 16, 8, 3),
                    (16, 64, 4, 2), (16, 32, 4, 3), (16, 16, 4, 4), (16, 32, 4, 4), (16, 64, 8, 2), (16, 128, 8, 1),
                    (16, 32, 2, 2), (16, 16, 2, 3)]
    if a.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    if a.quick:
        shapes, flash_launches, mla_launches = shapes[:2], flash_launches[:2], mla_launches[:2]
    if a.fp8_words:  # each case three times (default, bytes, words): the engine's launches and their neighbours
        split_opts = [None, 1]
        flash_launches = [None, (32, 2, 2), (64, 2, 2), (64, 4, 2), (32, 2, 1)]
        mla_launches = [None, (16, 32, 4, 2), (16, 64, 4, 2), (16, 32, 8, 2)]
    if a.flash_launches:
        # "64x4x3b": block numbers loaded a tile ahead (a fourth element, True)
        flash_launches = [None] + [_launch(la) for la in a.flash_launches.split(",")]
    if a.mla_launches:
        mla_launches = [None] + [_launch(la) for la in a.mla_launches.split(",")]
    rows = []
    # Cached bytes per context token and layer: K and V of 8 KV heads x 128; one 576-wide latent (2 bytes
    # an element in bf16, 1 in fp8).
    elem = 1 if a.fp8 else 2
    kinds = (("flash", flash_case, flash_launches, 8 * 128 * 2 * elem), ("mla", mla_case, mla_launches, 576 * elem))
    for kind, case, launches, per_token in kinds if a.mla_prefill is None else ():
        if a.only and kind != a.only:
            continue
        for batch, ctx in shapes:
            kv_bytes = batch * (ctx + 1) * per_token
            best = None
            # flash's words also without the next tile loaded ahead ("inline": fewer registers a thread)
            words = ((None, False, True) + (("inline",) if kind == "flash" else ())
                     if a.fp8_words and a.fp8 else (None,))
            for launch, splits, w in ((la, sp, w) for la in launches for sp in split_opts for w in words):
                extra = {} if w is None else {"fp8_words": w}
                args = {"fp8_words": True, "words_ahead": False} if w == "inline" else extra
                try:
                    ms = case(batch, ctx, splits, launch, a.fp8, **args)
                except Exception as exc:  # noqa: BLE001 -- a config that does not fit is a data point
                    rows.append({"kind": kind, "batch": batch, "ctx": ctx, "launch": launch, "splits": splits,
                                 **extra, "error": repr(exc)[:160]})
                    continue
                row = {"kind": kind, "batch": batch, "ctx": ctx, "launch": launch, "splits": splits, **extra,
                       "us": round(ms * 1e3, 2), "bw_frac": round(kv_bytes / ms / 1e6 / bw, 3)}
                rows.append(row)
                if best is None or ms < best[0]:
                    best = (ms, row)
            default = next(r for r in rows if r["kind"] == kind and r["batch"] == batch and r["ctx"] == ctx
                           and r["launch"] is None and r["splits"] is None and "fp8_words" not in r and "us" in r)
            print(json.dumps({"kind": kind, "batch": batch, "ctx": ctx, "default_us": default["us"],
                              "default_bw": default["bw_frac"], "best": best[1] if best else None}), flush=True)
            save(rows)  # after every shape: a cut run keeps what it measured
    for prompts, length in a.mla_prefill or ():
        best = None
        for launch in MLA_PREFILL_LAUNCHES:
            try:
                ms = mla_prefill_case(prompts, length, launch, a.fp8)
            except Exception as exc:  # noqa: BLE001 -- a config that does not fit is a data point
                rows.append({"kind": "mla-prefill", "prompts": prompts, "len": length, "launch": launch,
                             "error": repr(exc)[:160]})
                continue
            flops = 2 * (576 + 512) * 16 * prompts * length * (length + 1) / 2
            row = {"kind": "mla-prefill", "prompts": prompts, "len": length, "launch": launch,
                   "us": round(ms * 1e3, 2), "tflops": round(flops / ms / 1e9, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if best is None or ms < best[0]:
                best = (ms, row)
        print(json.dumps({"kind": "mla-prefill", "prompts": prompts, "len": length, "best": best and best[1]}),
              flush=True)
        save(rows)
    save(rows)


if __name__ == "__main__":
    main()
