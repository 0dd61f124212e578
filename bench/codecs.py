"""Image codec libraries side by side: which one the lossy input codec uses.

    python -m bench.codecs [--quick]

Writes bench/results/codecs.json.

The frame is a real photograph shipped with scikit-learn (``china.jpg``, 640x427),
whole and centre-cropped to 224x224 (a classifier's input). Each library encodes it
as JPEG at quality 90 and decodes it back, runs interleaved library by library so
that load from other processes hits all alike; medians per library and the ratio to
Pillow are reported. Pillow's WebP (method 0, the fastest) is timed beside it.
Libraries: Pillow (libjpeg-turbo and libwebp inside its wheels), simplejpeg
(libjpeg-turbo) and PyTurboJPEG (needs the system's libturbojpeg; recorded as
unavailable where it cannot load).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np

OUT = os.path.join(os.path.dirname(__file__), "results", "codecs.json")
QUALITY = 90


def _frames() -> dict[str, np.ndarray]:
    from sklearn.datasets import load_sample_image

    full = np.ascontiguousarray(load_sample_image("china.jpg"))
    h, w, _ = full.shape
    top, left = (h - 224) // 2, (w - 224) // 2
    return {"224x224": np.ascontiguousarray(full[top:top + 224, left:left + 224]), f"{w}x{h}": full}


def _pillow(fmt: str) -> tuple[Callable[[np.ndarray], bytes], Callable[[bytes], np.ndarray]]:
    from PIL import Image

    def enc(a: np.ndarray) -> bytes:
        buf = io.BytesIO()
        kw = {"method": 0} if fmt == "WEBP" else {}
        Image.fromarray(a).save(buf, format=fmt, quality=QUALITY, **kw)
        return buf.getvalue()

    def dec(b: bytes) -> np.ndarray:
        return np.asarray(Image.open(io.BytesIO(b)).convert("RGB"))

    return enc, dec


def _libraries() -> tuple[dict[str, tuple[Callable, Callable]], dict[str, str]]:
    libs: dict[str, tuple[Callable, Callable]] = {"pillow-jpeg": _pillow("JPEG"), "pillow-webp": _pillow("WEBP")}
    missing: dict[str, str] = {}
    try:
        import simplejpeg

        libs["simplejpeg"] = (lambda a: simplejpeg.encode_jpeg(a, quality=QUALITY, colorspace="RGB"),
                              lambda b: simplejpeg.decode_jpeg(b, colorspace="RGB"))
    except ImportError as e:
        missing["simplejpeg"] = str(e)
    try:
        import turbojpeg

        tj = turbojpeg.TurboJPEG()
        libs["pyturbojpeg"] = (lambda a: tj.encode(a, quality=QUALITY, pixel_format=turbojpeg.TJPF_RGB),
                               lambda b: tj.decode(b, pixel_format=turbojpeg.TJPF_RGB))
    except (ImportError, RuntimeError, OSError) as e:
        missing["pyturbojpeg"] = f"{type(e).__name__}: {e}".splitlines()[0]
    return libs, missing


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("pillow", "simplejpeg", "PyTurboJPEG"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


def run(repeats: int) -> dict:
    libs, missing = _libraries()
    frames = _frames()
    results: dict[str, dict[str, dict[str, float]]] = {}
    for frame_name, frame in frames.items():
        enc_s: dict[str, list[float]] = {k: [] for k in libs}
        dec_s: dict[str, list[float]] = {k: [] for k in libs}
        sizes: dict[str, int] = {}
        err: dict[str, float] = {}
        for _ in range(repeats):
            for name, (enc, dec) in libs.items():  # interleaved: one run of each library per round
                t0 = time.perf_counter()
                data = enc(frame)
                t1 = time.perf_counter()
                back = dec(data)
                t2 = time.perf_counter()
                enc_s[name].append(t1 - t0)
                dec_s[name].append(t2 - t1)
                sizes[name] = len(data)
                err[name] = float(np.mean(np.abs(back.astype(np.int16) - frame)))
        base_enc = statistics.median(enc_s["pillow-jpeg"])
        base_dec = statistics.median(dec_s["pillow-jpeg"])
        results[frame_name] = {
            name: {
                "encode_ms": statistics.median(enc_s[name]) * 1e3,
                "decode_ms": statistics.median(dec_s[name]) * 1e3,
                "encode_vs_pillow": statistics.median(enc_s[name]) / base_enc,
                "decode_vs_pillow": statistics.median(dec_s[name]) / base_dec,
                "bytes": sizes[name],
                "mean_abs_pixel_error": err[name],
            }
            for name in libs
        }
    return {
        "config": {"quality": QUALITY, "repeats": repeats, "frames": list(frames), "python": platform.python_version(),
                   "machine": platform.machine(), "versions": _versions(), "unavailable": missing},
        "results": results,
        "chosen": "pillow",
        "why": "Pillow: one dependency for both JPEG and WebP (libjpeg-turbo and libwebp inside its wheels, "
               "no system library). simplejpeg encodes about as fast and decodes faster (see the ratios), "
               "but only JPEG; PyTurboJPEG needs a system libturbojpeg that pip does not bring.",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--out", default=OUT, help="where the JSON goes")
    args = ap.parse_args(argv)
    report = run(repeats=15 if args.quick else 101)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1, sort_keys=True)
    for frame, rows in report["results"].items():
        for name, r in rows.items():
            print(f"{frame:>8} {name:<12} enc {r['encode_ms']:.3f} ms ({r['encode_vs_pillow']:.2f}x)  "
                  f"dec {r['decode_ms']:.3f} ms ({r['decode_vs_pillow']:.2f}x)  {r['bytes']} B")
    for name, why in report["config"]["unavailable"].items():
        print(f"{name}: unavailable ({why})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
