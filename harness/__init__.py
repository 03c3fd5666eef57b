"""Test and benchmark harness: drive Blink from outside, as a user or an operator would.

Not part of the installed product: the tests and ``bench/`` import it from a checkout.
``serve_proc`` runs ``blink serve`` as a child process; ``ring_driver`` drives an engine through the
ring with the frontend's slot code; ``models`` writes model folders of known shapes; ``sse`` reads
streamed responses.
"""
