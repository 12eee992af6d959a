"""loss.mode=distill's parts (docs/distill.md): loss.py (the divergence through both output heads in chunks),
teacher.py (the frozen teacher: loading, the vocabulary check). The mode itself is harness/modes/distill.py."""
