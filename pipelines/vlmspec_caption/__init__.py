"""Batch video captioning: a resumable job that captions folders of videos with tree speculative decoding.

A package of one concern per module: :mod:`.config` (settings), :mod:`.inputs` (what to caption, and frames),
:mod:`.models` (the pair), :mod:`.store` (the output file), :mod:`.run` (the loop and scale-out), :mod:`.cli`.
It is installed with vlmspec (``vlmspec caption`` finds it through the ``vlmspec.commands`` entry point).

Usage (``vlmspec caption``, ``python -m vlmspec_caption`` and the script take the same arguments, ``--debug``
included: the traceback of an unexpected error instead of one line)::

    python pipelines/video_captioning.py videos/ --out captions.jsonl --target testbed-base
    python pipelines/video_captioning.py "clips/**/*.mp4" --out captions.jsonl --target T --draft D --policy sage
    python pipelines/video_captioning.py manifest.jsonl --out captions.jsonl --fps 1 --max-pixels 50176
    accelerate launch --num_processes 4 pipelines/video_captioning.py videos/ --out captions.jsonl   # 4 GPUs
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 pipelines/video_captioning.py ...  # CPU

Inputs: a folder (its video files, by extension, recursively; id = path relative to the folder), a glob (every
file matched; id = the path as matched), or a manifest: ``.jsonl`` (one object per line) or ``.csv`` (a header
row) with ``path`` (or ``video``), optional ``prompt``, optional ``start``/``end`` (seconds: caption only that
segment, so rows can caption one file segment by segment; the record carries them) and optional ``id`` (default:
the path as written, ``path@start-end`` for a segment; relative paths are relative to the manifest's folder).
Manifests are UTF-8, with or without a byte order mark (Excel's "CSV UTF-8"). Ids must be unique: resuming keys on
them. ``--segment S`` (a finite number > 0) captions every whole video in windows of ``S`` seconds (``[0, S]``,
``[S, 2S]``, ..., the last to the end; bounds are multiples of ``S`` as written, ``0.9`` rather than
``0.8999999999999999``; ids ``id@start-end``): dense captions of long videos.

Structured captions: ``--structured-outputs '{"json": {...schema...}}'`` (or ``{"regex": ...}``, ``{"choice":
[...]}``; the config's ``structured_outputs``) makes every caption follow that structure, still the target's own
under it (``pipe(structured_outputs=...)``, :mod:`vlmspec.structured`); each line's settings record it.
A thinking model's captions: ``--reasoning-parser qwen3`` (the config's ``reasoning_parser``) makes each line's
``caption`` the answer after ``</think>`` and puts the reasoning under ``reasoning`` (:mod:`vlmspec.reasoning`).

Pictures too: ``--extensions images`` (or ``videos,images``; a group's name stands for its extensions) takes a
folder's pictures (``.jpg .jpeg .png .webp .bmp .gif .tif .tiff``), each captioned as an image
(``VLMSpecPipeline.__call__(path, prompt)``) with ``--image-prompt`` (default "Describe this image in detail.")
unless its manifest row (``path`` or ``image``) has a prompt of its own; a row may not bound a picture in time.

Settings come from ``configs/jobs/video_captioning.yaml`` (or ``--config``; read with ``yaml.safe_load``; unknown
keys are an error that lists the valid ones); command-line flags override the file.

Frames: by default ``num_frames`` frames sampled evenly with decord, inside the library
(``VLMSpecPipeline.__call__(None, prompt, video=path, num_frames=...)``). For the Qwen families, qwen-vl-utils'
sampling is offered instead (``--frame-sampler qwen``, chosen automatically by ``--fps``, ``--max-frames``,
``--min-pixels`` or ``--max-pixels``): its ``fetch_video`` reads local files offline with decord, picks the frame
count (``fps`` bounded by ``max_frames``, or ``num_frames``) and resizes frames to the model's patch grid within
``[min_pixels, max_pixels]``; the frames list then goes to the pipeline. The file is opened with decord first, so an
unreadable file gets a clear error (qwen-vl-utils would otherwise fall back to a torchvision reader that no longer
exists and report an AttributeError).

Output: one JSON object per line, one line per video, written whole (one ``write`` of the encoded line, then
``fsync``)::

    {"id": "a/clip1.mp4", "path": "videos/a/clip1.mp4", "prompt": "...", "caption": "...", "policy": "sage",
     "settings": {"max_new_tokens": 256, "num_frames": 8, "prune_ratio": null, "frame_sampler": "decord", ...},
     "model": {"target": "...", "draft": "..."}, "stats": {"new_tokens": ..., "mean_accepted": ..., ...}}
    {"id": "bad.mp4", "path": "videos/bad.mp4", "prompt": "...", "error": "video file ... could not be decoded
     (...)", "error_type": "ValueError", "policy": "sage", "settings": {...}, "model": {...}}

Success lines carry ``caption``, error lines ``error`` and ``error_type``; both carry ``id`` and ``path``. ``stats``
is ``SpecStats.to_dict()`` without the per-step ``trace`` (kept with ``--trace``). After the last video a summary
line goes to stdout: videos succeeded/failed, captioned videos/s and tokens/s (this run's captioned videos and their
tokens over its wall time after model loading; failed videos are not counted), mean tau (accepted draft tokens per
verification step over this run) and the policy, or, for lines an earlier run wrote with other settings, that they
did (how many, their policy and what differs). Exit status: 0
when every input has a caption, 2 when some failed, 1 when the job itself could not run (bad config or flag,
missing or unreadable input or manifest, unloadable model), with a message naming what is wrong.

Resume: rerun the same command. Videos whose id already has a caption line are skipped. Error lines are retried
by default (the old error line is dropped first; ``--no-retry-errors`` keeps them and skips those videos). On
start, a torn last line (no trailing newline, or not parsable) is truncated away; a damaged line elsewhere stops
the job with a message (it was not written by this job). Resuming keys on ids only: use a new ``--out`` when you
change the model or the generation settings (on every start, also when nothing is left to do, a warning counts the
captions written with other settings and names what differs).

Scale-out: under ``accelerate launch --num_processes N`` (or ``torchrun --nproc_per_node N``) the input list is split with ``PartialState().split_between_processes`` (contiguous, deterministic shards of the full input
list, so a rank owns the same videos on every restart); rank ``r`` appends to ``<out>.part<r>``. After
``wait_for_everyone()`` the main process merges ``<out>`` and every ``<out>.part*`` into ``<out>`` (one line per id,
a caption preferred to an error and otherwise the later line, in input order, ids not in the inputs kept at the
end), written to a temporary file, fsynced and renamed over ``<out>``; the part files are then removed. A killed
multi-process job resumes per part; every process counts the lines in ``<out>`` and all part files as done, so a
restart with another number of processes (or a single process) also skips them. A single process appends to
``<out>`` itself and ends with the same merge. ``--device-map auto`` passes ``device_map`` to ``from_pretrained``
so that a large target (72B) spans the GPUs of one process. On a machine without GPUs, accelerate 1.x starts
several CPU processes only through MPI: ``accelerate launch --cpu --num_processes 2`` runs ONE process (correct,
not sharded); use ``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2`` or ``torchrun``. A
launch whose processes do not see each other stops with an error instead of captioning everything twice. Under a
launcher, a partial result (exit status 2 of the main process) shows as the launcher's failure (status 1).

Batching: ``--batch-size B`` captions ``B`` videos at once (``pipe.batch_iter``, :mod:`vlmspec.batching`): each
video keeps its own tree, the target verifies all of them in one forward, a finished video's line is written at once
and the next video takes its row. The default (``batch_size: null``) is chosen from the pipeline's cost probe
(``pipe.default_batch_size()``). Captions, their order in the file, resume and error lines are the same at any batch
size; the bench's throughput section (``vlmspec bench --throughput``) compares it with transformers' batched
``generate()``.
"""

from .cli import add_arguments, build_parser, main, overrides_from_args, run_args
from .config import (
    DEFAULT_CONFIG_PATH,
    EXIT_INTERRUPTED,
    EXIT_JOB_ERROR,
    EXIT_OK,
    EXIT_PARTIAL,
    JobConfig,
    JobError,
    load_config,
    read_config_file,
)
from .inputs import VideoItem, discover_inputs, frame_source, qwen_frames, segment_items
from .models import load_pipeline, resolve_pair, run_meta
from .run import JobSummary, run_job
from .store import (
    RECORD_START,
    ResultWriter,
    encode_record,
    merge_outputs,
    part_files,
    part_path,
    read_output,
    scan_output,
)

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "EXIT_INTERRUPTED",
    "EXIT_JOB_ERROR",
    "EXIT_OK",
    "EXIT_PARTIAL",
    "RECORD_START",
    "JobConfig",
    "JobError",
    "JobSummary",
    "ResultWriter",
    "VideoItem",
    "add_arguments",
    "build_parser",
    "discover_inputs",
    "encode_record",
    "frame_source",
    "load_config",
    "load_pipeline",
    "main",
    "merge_outputs",
    "overrides_from_args",
    "part_files",
    "part_path",
    "qwen_frames",
    "read_config_file",
    "read_output",
    "resolve_pair",
    "run_args",
    "run_job",
    "run_meta",
    "segment_items",
    "scan_output",
]
