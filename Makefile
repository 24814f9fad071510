# The two commands of the README. Each installs what it needs into the current Python first.
PYTHON ?= python3

.PHONY: install demo test bench

# Editable in strict mode: the installed `pdserve` tree is links to the repository's files, laid out as
# installed, so tools that walk the package on disk (import-linter) see every subpackage. A module
# added later needs `make install` again to be linked in.
# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build. A torch that
# is already importable (a GPU machine's own build) is left alone.
# Then pdserve's bytecode, compiled once: a process that may not write it (PYTHONDONTWRITEBYTECODE, as
# CI sets) would otherwise compile every module it imports, each Ray worker of a test cluster too.
install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[server,test,bench]" --config-settings editable_mode=strict
	$(PYTHON) -c "import compileall, os, sys, pdserve; sys.exit(not compileall.compile_dir(os.path.dirname(pdserve.__file__), quiet=1))"

demo: install
	pdserve demo

# Two test processes (pytest-xdist), a file at a time each: the cluster tests wait on Ray, sockets and
# timeouts much of the time, so two share the CI machine's two cores well. Each has its own Ray runtime.
test: install
	$(PYTHON) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder --durations=15

bench: install
	pdserve bench engine
