"""``fprep.save(..., wait=False)``: copies staged before returning, written in the background.

``staging`` copies every tensor into reused host buffers (pinned, on a side stream, for
accelerator tensors), ``background`` writes and publishes on a thread of its own, and
``verify`` reads the written files back before ``latest`` may name them.
"""
