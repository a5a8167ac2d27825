"""Write more text-in-photo samples, laid out as ../shared/text-samples, for a held-out OCR judgement.

bench_ocr.py judges on images 0100-0199 of text-samples; choices made while looking at those figures
are tuned to them. This writes other scenes the same way (words, numbers, prices and dates drawn
in DejaVu fonts onto photos, 16-56 px, some on plates, some rotated up to 6 degrees; labels.json
with each word's box and quadrilateral; one crop per level word, its box plus 3 px, in crops.tsv),
so a change can be decided on scenes bench_ocr never sees:

    python benchmarks/make_text_samples.py --photos ../shared/imagenet-samples --out DIR \\
        --first 100 --n 300 --seed 7 --link-calib ../shared/text-samples

--first names the scenes from that number on (bench_ocr takes 0000-0099 as calibration, the rest
as evaluation); --link-calib links the calibration scenes 0000-0099 and their crops of another
folder in, so that `bench_ocr.py --text-samples OUT` calibrates exactly as on the shared samples and
judges on the new scenes. The vocabulary is the photos' ImageNet class names.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import re
import sys

from PIL import Image, ImageDraw, ImageFont

FONT_DIRS = ("/usr/share/fonts/truetype/dejavu", "/usr/share/fonts/dejavu", "/usr/share/fonts/TTF")
W, H = 640, 480


def fonts():
    found = []
    for d in FONT_DIRS:
        found += sorted(glob.glob(os.path.join(d, "DejaVu*.ttf")))
    # ExtraLight strokes are a pixel wide at 16 px: not what the shared samples hold
    return [f for f in found if "ExtraLight" not in f]


def vocabulary(photos):
    words = set()
    for p in photos:
        stem = os.path.splitext(os.path.basename(p))[0]
        for w in re.split(r"[_\W]+", stem.split("_", 1)[-1]):
            if w.isalpha() and len(w) >= 3:
                words.add(w.lower())
    return sorted(words)


def a_text(rng, words):
    kind = rng.random()
    if kind < 0.15:
        return str(rng.randint(100, 99999))
    if kind < 0.22:
        return f"${rng.randint(1, 999)}.{rng.randint(0, 99):02d}"
    if kind < 0.28:
        return f"{rng.randint(1, 28):02d}/{rng.randint(1, 12):02d}/{rng.randint(1990, 2030)}"
    t = " ".join(rng.choice(words) for _ in range(1 if rng.random() < 0.6 else 2))
    case = rng.random()
    return t.upper() if case < 0.3 else t.capitalize() if case < 0.7 else t


def scene(photo):
    im = Image.open(photo).convert("RGB")
    im.info.clear()  # no ICC profile carried into the scenes and crops
    s = max(W / im.width, H / im.height)
    im = im.resize((max(W, round(im.width * s)), max(H, round(im.height * s))), Image.BILINEAR)
    x0, y0 = (im.width - W) // 2, (im.height - H) // 2
    return im.crop((x0, y0, x0 + W, y0 + H))


def overlaps(box, boxes, gap=6):
    return any(box[0] < b[2] + gap and b[0] < box[2] + gap and box[1] < b[3] + gap and b[1] < box[3] + gap
               for b in boxes)


def draw_word(im, rng, text, font, boxes):
    """Draw text somewhere free; its label, or None when it does not fit."""
    l, t, r, b = font.getbbox(text)
    tw, th = r - l, b - t
    plate = rng.random() < 0.3
    pad = max(3, th // 4) if plate else 0
    angle = rng.uniform(-6, 6) if rng.random() < 0.3 else 0.0
    lw, lh = tw + 2 * pad, th + 2 * pad
    if lw > W - 8 or lh > H - 8:
        return None
    rad = math.radians(angle)
    bw = int(math.ceil(abs(lw * math.cos(rad)) + abs(lh * math.sin(rad))))
    bh = int(math.ceil(abs(lw * math.sin(rad)) + abs(lh * math.cos(rad))))
    for _ in range(30):
        cx, cy = rng.uniform(bw / 2 + 2, W - bw / 2 - 2), rng.uniform(bh / 2 + 2, H - bh / 2 - 2)
        box = [int(math.floor(cx - bw / 2)), int(math.floor(cy - bh / 2)),
               int(math.ceil(cx + bw / 2)), int(math.ceil(cy + bh / 2))]
        if not overlaps(box, boxes):
            break
    else:
        return None
    region = im.crop(tuple(box)).convert("L")
    mean = sum(i * c for i, c in enumerate(region.histogram())) / max(1, region.width * region.height)
    dark = mean > 128
    ink = tuple(rng.randint(0, 50) for _ in range(3)) if dark else tuple(rng.randint(205, 255) for _ in range(3))
    layer = Image.new("RGBA", (lw, lh), (0, 0, 0, 0))
    d = ImageDraw.Draw(layer)
    if plate:
        paper = tuple(rng.randint(215, 255) for _ in range(3)) if rng.random() < 0.7 else \
            tuple(rng.randint(0, 60) for _ in range(3))
        ink = tuple(rng.randint(0, 50) for _ in range(3)) if sum(paper) > 384 else \
            tuple(rng.randint(205, 255) for _ in range(3))
        d.rectangle((0, 0, lw - 1, lh - 1), fill=paper + (255,))
    d.text((pad - l, pad - t), text, font=font, fill=ink + (255,))
    rot = layer.rotate(angle, resample=Image.BICUBIC, expand=True)
    ox, oy = int(round(cx - rot.width / 2)), int(round(cy - rot.height / 2))
    im.paste(rot, (ox, oy), rot)
    # the quadrilateral: the text layer's corners turned by angle (PIL turns counter-clockwise)
    c, s = math.cos(-rad), math.sin(-rad)
    poly = [[round(cx + (x - lw / 2) * c - (y - lh / 2) * s, 1), round(cy + (x - lw / 2) * s + (y - lh / 2) * c, 1)]
            for x, y in ((0, 0), (lw, 0), (lw, lh), (0, lh))]
    xs, ys = [p[0] for p in poly], [p[1] for p in poly]
    tight = [max(0, int(min(xs))), max(0, int(min(ys))), min(W, int(math.ceil(max(xs)))), min(H, int(math.ceil(max(ys))))]
    boxes.append(box)
    return {"text": text, "box": tight, "poly": poly, "angle": round(angle, 2)}


def link_calib(src, out, labels, crop_lines):
    with open(os.path.join(src, "labels.json"), encoding="utf-8") as f:
        theirs = json.load(f)
    for fn, words in theirs.items():
        if int(fn[:4]) < 100:
            labels[fn] = words
            os.symlink(os.path.abspath(os.path.join(src, "images", fn)), os.path.join(out, "images", fn))
    with open(os.path.join(src, "crops.tsv"), encoding="utf-8") as f:
        for line in f:
            if line.strip() and int(line[:4]) < 100:
                fn = line.split("\t", 1)[0]
                os.symlink(os.path.abspath(os.path.join(src, "crops", fn)), os.path.join(out, "crops", fn))
                crop_lines.append(line.rstrip("\n"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--photos", required=True, help="folder of photos (the backgrounds)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--first", type=int, default=100, help="number of the first scene written")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--link-calib", help="text-samples folder whose scenes 0000-0099 are linked in")
    a = ap.parse_args(argv)
    photos = sorted(p for p in glob.glob(os.path.join(a.photos, "*")) if p.lower().endswith((".jpeg", ".jpg", ".png")))
    faces = fonts()
    if not photos or not faces:
        sys.exit(f"make_text_samples: {'no photos in ' + a.photos if not photos else 'no DejaVu fonts found'}")
    if os.path.exists(a.out):
        sys.exit(f"make_text_samples: {a.out} exists; give a new folder")
    os.makedirs(os.path.join(a.out, "images"))
    os.makedirs(os.path.join(a.out, "crops"))
    rng = random.Random(a.seed)
    words = vocabulary(photos)
    labels, crop_lines = {}, []
    if a.link_calib:
        link_calib(a.link_calib, a.out, labels, crop_lines)
    for i, photo in enumerate(rng.sample(photos, a.n)):
        fn = f"{a.first + i:04d}.jpg"
        im = scene(photo)
        boxes, placed = [], []
        for _ in range(rng.randint(3, 7)):
            font = ImageFont.truetype(rng.choice(faces), rng.randint(16, 56))
            w = draw_word(im, rng, a_text(rng, words), font, boxes)
            if w:
                placed.append(w)
        im.save(os.path.join(a.out, "images", fn), quality=90)
        labels[fn] = placed
        for k, w in enumerate(placed):
            if w["angle"] == 0.0:
                x0, y0, x1, y1 = w["box"]
                crop = im.crop((max(0, x0 - 3), max(0, y0 - 3), min(W, x1 + 3), min(H, y1 + 3)))
                cn = f"{fn[:4]}_{k}.png"
                crop.save(os.path.join(a.out, "crops", cn))
                crop_lines.append(f"{cn}\t{w['text']}")
    with open(os.path.join(a.out, "labels.json"), "w", encoding="utf-8") as f:
        json.dump(dict(sorted(labels.items())), f, indent=0)
    with open(os.path.join(a.out, "crops.tsv"), "w", encoding="utf-8") as f:
        f.write("\n".join(sorted(crop_lines)) + "\n")
    print(f"wrote {a.n} scenes ({sum(len(labels[f'{a.first + i:04d}.jpg']) for i in range(a.n))} words) to {a.out}")


if __name__ == "__main__":
    main()
