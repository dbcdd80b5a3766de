"""`dcp-compile doctor`: checks, on the machine it runs on, every assumption a back end's lowering
makes of the vendor's ops, collectives and graphs, and says which options are safe there. It runs
the whole pipeline (models, apply, graph runners), so it sits above them, beside the harness."""
