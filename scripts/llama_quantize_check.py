"""Check stratad against llama.cpp's own quantiser (issue 27): run `llama-quantize` on a float qwen3moe GGUF for
each file type, then for each output

- does stratad load it (ModelFile) and run it (the numpy reference engine, canonical experts: finite logits, a
  short greedy generation, how many of its tokens agree with the float model's),
- does every tensor have the type stratad's own generator gives that `--mix` (stratad/model/mixes.py); every
  difference is listed, grouped as name pattern / llama.cpp's type / ours / layers,
- does stratad's decoding (quants.dequantize) equal gguf-py's (gguf.quants.dequantize) on llama.cpp's bytes, bit
  for bit,
- a sanity error figure: llama.cpp's quantised weights decoded with gguf-py against the float source (relative RMS
  over all quantised tensors, and the worst tensor).

Each file type is quantised twice by default: without an importance matrix (what a user gets from
`llama-quantize in.gguf out.gguf Q4_K_M`) and with a synthetic one (every column weight 1, written by this
script in llama.cpp's GGUF imatrix layout). mixes.py models files made with an importance matrix, so its table is
compared with the second run; the first shows the rules that depend on the imatrix (and which file types
llama.cpp refuses without one). Exit status 1 when a check fails (each failure on stderr, `FAILED ...`): a file
that does not load, generate or decode as gguf-py does, a wrong general.file_type, and, with the imatrix, a tensor
type that is not mixes.py's.

  python scripts/llama_quantize_check.py --llama-quantize /tmp/llama-build/bin/llama-quantize \\
      --model /tmp/tiny-f32.gguf [--model ...] [--types Q4_K_M,IQ3_S] [--imatrix none|uniform|both] \\
      [--llama-version b11434] [--json out.json]

The float model: `stratad make-model --preset tiny --mix f32 --out /tmp/tiny-f32.gguf` (or f16 / bf16), or any
qwen3moe GGUF whose matrices are F32 / F16 / BF16.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from stratad.engine.reference import ReferenceEngine  # noqa: E402
from stratad.engine.sampling import SamplingParams  # noqa: E402
from stratad.model import mixes, quants  # noqa: E402
from stratad.model.gguf_file import ModelFile  # noqa: E402

# the file types llama-quantize offers that stratad's --mix knows (its name for each), lowest bits last; MXFP4_MOE
# (MXFP4 experts) beside them
FILE_TYPES = ["Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_1", "Q4_0", "IQ4_XS",
              "IQ4_NL", "MXFP4_MOE", "Q3_K_L", "Q3_K_M", "Q3_K_S", "IQ3_M", "IQ3_S", "IQ3_XS", "IQ3_XXS", "Q2_K",
              "Q2_K_S", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S"]
PROMPT = "The quantiser and the loader agree"
GREEDY_TOKENS = 8


def quantisable(reader: gguf.GGUFReader) -> dict[str, tuple[int, int]]:
    """name -> (matrices, row length) for every tensor llama.cpp quantises in a qwen3moe file (2-D / 3-D weights,
    not the norms or the router): the imatrix entries it looks up."""
    out = {}
    for t in reader.tensors:
        ne = [int(x) for x in t.shape]  # ggml order: ne0 first
        if len(ne) < 2 or not t.name.endswith("weight") or "_norm.weight" in t.name or "ffn_gate_inp" in t.name:
            continue
        out[t.name] = (ne[2] if len(ne) > 2 else 1, ne[0])
    return out


def write_uniform_imatrix(path: Path, reader: gguf.GGUFReader) -> None:
    """A synthetic importance matrix in llama.cpp's GGUF imatrix layout (`<tensor>.in_sum2`, `<tensor>.counts`, the
    imatrix.* keys): every column of every matrix weighted 1. It makes llama-quantize take its imatrix paths (the
    rules mixes.py models) without changing which values matter."""
    w = gguf.GGUFWriter(str(path), arch="imatrix")
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["uniform (stratad llama_quantize_check)"])
    w.add_uint32("imatrix.chunk_count", 1)
    w.add_uint32("imatrix.chunk_size", 1)
    for name, (mats, n) in quantisable(reader).items():
        w.add_tensor(f"{name}.in_sum2", np.ones((mats, n), dtype=np.float32))
        w.add_tensor(f"{name}.counts", np.ones((mats, 1), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(binary: str, src: Path, out: Path, ftype: str, imatrix: Path | None, threads: int) -> dict:
    cmd = [binary] + (["--imatrix", str(imatrix)] if imatrix else []) + [str(src), str(out), ftype, str(threads)]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True)
    res = {"rc": r.returncode, "quantize_s": round(time.monotonic() - t0, 2)}
    v = re.search(r"^version: (.*)$", r.stdout + r.stderr, re.M)
    if v:
        res["version_line"] = v.group(1).strip()
    if r.returncode:
        text = r.stdout + r.stderr
        why = re.search(r"offending tensor: (\S+)\s*\n\s*- target type: (\S+)", text)
        err = re.findall(r"(?:error|ERROR|failed)[^\n]*", text)
        res["refused"] = (f"needs an importance matrix ({why.group(1)} -> {why.group(2)})" if why
                          else (err[-1] if err else text.strip().splitlines()[-1] if text.strip() else "no output"))
    fallbacks = re.findall(r"warning: (\S+)\s+- ncols\s+(\d+) not divisible by\s+(\d+) \(required for type\s+(\S+)\)"
                           r".*?-> falling back to\s+(\S+)", r.stdout + r.stderr)
    if fallbacks:
        res["fallbacks"] = [{"tensor": f[0], "row": int(f[1]), "wanted": f[3], "got": f[4]} for f in fallbacks]
    return res


def pattern(name: str) -> tuple[str, int | None]:
    m = re.match(r"blk\.(\d+)\.(.*)", name)
    return (f"blk.*.{m.group(2)}", int(m.group(1))) if m else (name, None)


def compare_types(m: ModelFile, ftype: gguf.LlamaFileType, src_types: dict[str, T]) -> list[dict]:
    """Every tensor whose type in llama.cpp's file differs from what mixes.py gives it, grouped by pattern."""
    groups: dict[tuple, list] = defaultdict(list)
    for name, ti in m.tensors.items():
        want = mixes.tensor_type(ftype, name, ti.shape[-1], m.config)
        if want is None:
            want = src_types[name]  # not quantised: as the source has it
        if ti.qtype != want:
            pat, layer = pattern(name)
            groups[(pat, ti.qtype.name, want.name)].append(layer)
    return [{"tensor": p, "llama_cpp": a, "mixes_py": b,
             "layers": sorted(x for x in ls if x is not None) or None} for (p, a, b), ls in sorted(groups.items())]


def decode_checks(out_reader: gguf.GGUFReader, src: dict[str, np.ndarray], m: ModelFile) -> dict:
    """gguf-py's decoding of llama.cpp's bytes vs the float source (relative RMS), and stratad's decoding vs
    gguf-py's (bit for bit), over every quantised tensor."""
    err2 = ref2 = 0.0
    worst, per_type, inexact = ("", 0.0), defaultdict(lambda: [0.0, 0.0]), []
    for t in out_reader.tensors:
        qt = T(int(t.tensor_type))
        if qt in (T.F32,) or t.name not in src:
            continue
        got = gguf.quants.dequantize(t.data, qt).astype(np.float32).reshape(src[t.name].shape)
        ours = quants.dequantize(qt, m.raw(t.name))
        if ours.shape != got.shape or not np.array_equal(ours.view(np.uint32), got.view(np.uint32)):
            inexact.append(f"{t.name} ({qt.name})")
        ref = src[t.name]
        e2, r2 = float(np.sum((got - ref) ** 2, dtype=np.float64)), float(np.sum(ref ** 2, dtype=np.float64))
        err2, ref2 = err2 + e2, ref2 + r2
        per_type[qt.name][0] += e2
        per_type[qt.name][1] += r2
        rel = (e2 / r2) ** 0.5 if r2 else 0.0
        if rel > worst[1]:
            worst = (f"{t.name} ({qt.name})", rel)
    return {"rel_rms": round((err2 / ref2) ** 0.5, 5) if ref2 else 0.0,
            "rel_rms_by_type": {k: round((a / b) ** 0.5, 5) for k, (a, b) in sorted(per_type.items()) if b},
            "worst_tensor": worst[0], "worst_rel_rms": round(worst[1], 5),
            "stratad_decode_exact": not inexact, "stratad_decode_differs": inexact[:10]}


def greedy(m: ModelFile) -> tuple[list[int], bool]:
    eng = ReferenceEngine(m, "canonical")
    prompt = m.tokenizer.encode(PROMPT)
    logits = eng.forward(prompt, eng.new_kv(), logits="all")
    finite = bool(np.all(np.isfinite(logits)))
    toks = list(eng.generate(prompt, SamplingParams(max_tokens=GREEDY_TOKENS))) if finite else []
    return toks, finite


def check_one(binary: str, src: Path, src_arrays: dict, src_types: dict, float_tokens: list[int], ftype_name: str,
              imatrix: Path | None, work: Path, threads: int, keep: bool) -> dict:
    ftype = mixes.parse_mix(ftype_name)
    out = work / f"{ftype_name}-{'imatrix' if imatrix else 'plain'}.gguf"
    row = {"file_type": ftype_name, "imatrix": "uniform" if imatrix else "none"}
    row.update(quantize(binary, src, out, ftype_name, imatrix, threads))
    if row["rc"]:
        row.update(loads=None, types_match=None, greedy_ok=None)
        return row
    try:
        m = ModelFile(out)
    except Exception as e:  # noqa: BLE001 - the report is the point
        row.update(loads=False, load_error=f"{type(e).__name__}: {e}", types_match=None, greedy_ok=None)
        return row
    try:
        row["loads"] = True
        row["general_file_type"] = m.meta("general.file_type")
        row["file_type_key_ok"] = row["general_file_type"] == int(ftype)
        row["types_in_file"] = dict(sorted(
            Counter(ti.qtype.name for ti in m.tensors.values()).items()))
        row["differences"] = compare_types(m, ftype, src_types)
        row["types_match"] = not row["differences"]
        r = gguf.GGUFReader(str(out))
        row.update(decode_checks(r, src_arrays, m))
        del r
        try:
            toks, finite = greedy(m)
            agree = sum(a == b for a, b in zip(toks, float_tokens))
            row.update(logits_finite=finite, greedy_tokens=toks, greedy_agree_with_float=f"{agree}/{len(float_tokens)}",
                       greedy_ok=finite and len(toks) > 0)
        except Exception as e:  # noqa: BLE001
            row.update(greedy_ok=False, greedy_error=f"{type(e).__name__}: {e}")
    finally:
        m.close()
        if not keep:
            out.unlink(missing_ok=True)
    return row


def run_check(binary: str, model: Path, types: list[str], imatrix_modes: list[str], work: Path | None = None,
              threads: int = 2, keep: bool = False, log=print, llama_version: str = "") -> dict:
    """Quantise `model` to each file type (per imatrix mode: "none", "uniform") and check each output; the rows
    and what was checked, as the JSON the script writes. work: where the files go; None: a temporary folder,
    deleted at the end (unless keep: then its path is logged). The imatrix file is deleted unless keep."""
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="llq-")) if own else work
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _run_check(binary, model, types, imatrix_modes, work, threads, keep, log, llama_version)
    finally:
        if own and not keep:
            shutil.rmtree(work, ignore_errors=True)
        elif own:
            log(f"quantised files kept in {work}")


def _run_check(binary: str, model: Path, types: list[str], imatrix_modes: list[str], work: Path, threads: int,
               keep: bool, log, llama_version: str) -> dict:
    src_reader = gguf.GGUFReader(str(model))
    src_types = {t.name: T(int(t.tensor_type)) for t in src_reader.tensors}
    names = quantisable(src_reader)
    src_arrays = {t.name: gguf.quants.dequantize(t.data, T(int(t.tensor_type))).astype(np.float32)
                  for t in src_reader.tensors if t.name in names}
    imatrix = None
    if "uniform" in imatrix_modes:
        imatrix = work / "uniform.imatrix.gguf"
        write_uniform_imatrix(imatrix, src_reader)
    del src_reader
    fm = ModelFile(model)
    float_tokens, _ = greedy(fm)
    cfg = fm.config
    fm.close()
    rows = []
    try:
        for mode in imatrix_modes:
            for ft in types:
                t0 = time.monotonic()
                row = check_one(binary, model, src_arrays, src_types, float_tokens, ft,
                                imatrix if mode == "uniform" else None, work, threads, keep)
                row["check_s"] = round(time.monotonic() - t0, 2)
                rows.append(row)
                log(line(row))
    finally:
        if imatrix is not None and not keep:
            imatrix.unlink(missing_ok=True)
    return {"llama_quantize": str(binary), "llama_cpp_version": llama_version,
            "binary_version_line": next((r["version_line"] for r in rows if "version_line" in r), ""),
            "model": str(model),
            "model_config": {k: getattr(cfg, k) for k in ("n_layer", "d_model", "n_head", "n_head_kv", "head_dim",
                                                          "n_expert", "n_expert_used", "d_ff_expert", "vocab_size")},
            "source_types": dict(Counter(t.name for t in src_types.values())),
            "float_greedy_tokens": float_tokens, "rows": rows}


HEADER = (f"{'file type':<9} {'imatrix':<8} {'quantize':<9} {'loads':<6} {'types=mixes':<12} {'greedy':<7} "
          f"{'agree':<6} {'decode=gguf':<12} {'rel_rms':<8} notes")


def _yn(v) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def line(r: dict) -> str:
    note = r.get("refused") or r.get("load_error") or r.get("greedy_error") or ""
    if r.get("differences"):
        note = "; ".join(f"{d['tensor']} {d['llama_cpp']} (ours {d['mixes_py']})"
                         + (f" L{','.join(map(str, d['layers']))}" if d["layers"] else "") for d in r["differences"])
    if r.get("fallbacks"):
        note += f" [{len(r['fallbacks'])} fallbacks]"
    return (f"{r['file_type']:<9} {r['imatrix']:<8} {'ok' if not r['rc'] else 'refused':<9} {_yn(r.get('loads')):<6} "
            f"{_yn(r.get('types_match')):<12} {_yn(r.get('greedy_ok')):<7} {r.get('greedy_agree_with_float', '-'):<6} "
            f"{_yn(r.get('stratad_decode_exact')):<12} {r.get('rel_rms', '-')!s:<8} {note}")


def failures(rows: list[dict]) -> list[str]:
    """What failed, a line a row: a file llama.cpp wrote that stratad does not load, generate from, decode as
    gguf-py does, or whose general.file_type is not the one asked for; with an importance matrix, a tensor whose type
    is not mixes.py's (without one, the differences are the imatrix-dependent rules: reported, not failures). A
    file type llama.cpp refuses is not stratad's failure (its row says why)."""
    out = []
    for r in rows:
        if r["rc"]:
            continue
        what = f"{r['file_type']} ({r['imatrix']} imatrix)"
        if not r.get("loads"):
            out.append(f"{what}: does not load ({r.get('load_error', '')})")
            continue
        problems = [p for p, bad in (
            ("no greedy generation" + (f" ({r['greedy_error']})" if r.get("greedy_error") else ""),
             not r.get("greedy_ok")),
            ("stratad's decoding differs from gguf-py's: " + ", ".join(r.get("stratad_decode_differs", ())),
             not r.get("stratad_decode_exact")),
            (f"general.file_type {r.get('general_file_type')}", not r.get("file_type_key_ok")),
            (f"{len(r.get('differences') or ())} tensor types differ from mixes.py's",
             r["imatrix"] == "uniform" and not r.get("types_match"))) if bad]
        if problems:
            out.append(f"{what}: " + "; ".join(problems))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--llama-quantize", default=os.environ.get("LLAMA_QUANTIZE"),
                    help="the binary (else $LLAMA_QUANTIZE)")
    ap.add_argument("--model", required=True, action="append",
                    help="a float (F32/F16/BF16) qwen3moe GGUF; repeat for several shapes")
    ap.add_argument("--types", default=",".join(FILE_TYPES), help="comma-separated llama-quantize file types")
    ap.add_argument("--imatrix", choices=["none", "uniform", "both"], default="both")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", help="where the quantised files go (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the quantised files and the imatrix (and the "
                    "temporary folder, without --work)")
    ap.add_argument("--llama-version", default="", help="the llama.cpp version the binary was built from, for the "
                    "JSON (a build from a source archive reports 'build 0, commit unknown')")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    if not a.llama_quantize:
        ap.error("--llama-quantize (or $LLAMA_QUANTIZE) is required")
    modes = ["none", "uniform"] if a.imatrix == "both" else [a.imatrix]
    types = [t.strip().upper() for t in a.types.split(",") if t.strip()]
    results = []
    for model in a.model:
        print(f"\n{model}\n{HEADER}")
        results.append(run_check(a.llama_quantize, Path(model), types, modes, Path(a.work) if a.work else None,
                                 a.threads, a.keep, llama_version=a.llama_version))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        out = results[0] if len(results) == 1 else {
            "llama_quantize": str(a.llama_quantize), "llama_cpp_version": a.llama_version,
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "models": results}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    bad = failures([r for res in results for r in res["rows"]])
    for b in bad:
        print(f"FAILED {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
