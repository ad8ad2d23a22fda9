"""Batch jobs built on :mod:`vlmspec` (``video_captioning``: resumable batch video captioning).

Each job is a module that can be imported (``from pipelines import video_captioning``, from the repository root)
and run as a script (``python pipelines/video_captioning.py ...``, also under ``accelerate launch``).
"""
