# Shortcuts for the test commands in README's Test section.
.PHONY: test slow

test:  ## the default tests (slow ones excluded)
	python -m pytest -q

slow:  ## every slow test (scripts/slow.sh)
	scripts/slow.sh
