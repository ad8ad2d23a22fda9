"""The procedural testbed world: seeded scenes of shapes, their pictures/clips and their texts.

Every example is a pure function of ``(task, seed)``. A *scene* is 1-3 shapes (kind, colour, size) on a
3x3 grid of cells over a plain background; a *clip* is 1-3 shape *tracks*, each with one event (stays, moves,
appears, disappears, turns another colour) over :data:`NUM_FRAMES` frames. Pictures are ``IMAGE_SIDE`` pixels
square, so one grid cell is exactly one merged Qwen2-VL visual token (28x28 pixels).

Texts mix three kinds of spans, so that a model that sees the picture is confident on some runs of tokens and
uncertain on others (the entropy autocorrelation SAGE relies on):

* spans fixed by the scene (``a large red circle at the top left``): low entropy for a model that sees it;
* spans fixed by the grammar (``The image shows``, ``on a``, ``The second shape is``): low entropy;
* genuinely random runs of several words (``It looks calm bright bold.``, ``The mood is ...``): high entropy
  for every model, however good.

Questions (``image_qa``) have short, fully determined answers (exact match). :func:`caption_facts` extracts the
scene-determined words of a caption so a generated caption can be scored against the reference.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only
    import PIL.Image

__all__ = [
    "TASKS",
    "Clip",
    "Example",
    "Scene",
    "Shape",
    "Track",
    "caption_facts",
    "fact_accuracy",
    "lexicon",
    "reply_words",
    "sample",
    "write_video",
]

TASKS: tuple[str, ...] = ("image_caption", "image_qa", "video_caption")
"""Tasks :func:`sample` can draw."""

IMAGE_SIDE = 84  # pixels; 3x3 cells of 28 px = 3x3 merged Qwen2-VL tokens
GRID = 3
NUM_FRAMES = 4
CHANGE_FRAME = 1
"""Appear, disappear and turn events show from this frame on (moves glide over the whole clip): Qwen2-VL merges
frame pairs (temporal patch 2), so its first frame pair holds a clip's before and after."""
MAX_SHAPES = 3

KINDS: tuple[str, ...] = ("circle", "square", "triangle", "diamond")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 90, 235),
    "yellow": (240, 220, 40),
    "purple": (150, 60, 200),
    "orange": (245, 140, 30),
    "white": (240, 240, 240),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "black": (40, 40, 40),
    "gray": (120, 120, 120),
    "brown": (110, 75, 45),
}
LIGHT = 30  # background lighting: brightness -LIGHT (top) .. +LIGHT (bottom); red -> blue tint left -> right
SIZES: dict[str, int] = {"small": 7, "large": 12}  # half extent in pixels (cells are 28 px)
POSITIONS: tuple[str, ...] = (
    "top left", "top middle", "top right",
    "middle left", "center", "middle right",
    "bottom left", "bottom middle", "bottom right",
)  # fmt: skip
"""Cell names in reading order: a row word and a column word (no name is a prefix of another)."""
COUNTS: tuple[str, ...] = ("zero", "one", "two", "three", "four")
ORDINALS: tuple[str, ...] = ("first", "second", "third")
"""Each shape sentence opens with its rank in reading order (``The second shape is ...``): which shape a
sentence is about is then named by the grammar, not left for the model to infer by counting earlier sentences."""
EVENTS: tuple[str, ...] = ("stays", "moves", "appears", "disappears", "turns")

# Random runs (high entropy for any model): words drawn uniformly, without repetition within a run.
LOOKS: tuple[str, ...] = (
    "bright", "calm", "soft", "sharp", "shiny", "old", "new", "quiet",
    "happy", "strange", "smooth", "bold", "gentle", "plain", "lively", "neat",
)  # fmt: skip
MOODS: tuple[str, ...] = (
    "peaceful", "playful", "serious", "dreamy", "busy", "lonely", "friendly", "mysterious",
    "simple", "cozy", "warm", "cold", "modern", "classic", "tense", "relaxed",
)  # fmt: skip
LOOK_WORDS = 3  # words per "It looks ..." run
MOOD_WORDS = (3, 4)  # length range of the closing "The mood is ..." run

CAPTION_PROMPTS: tuple[str, ...] = (
    "Describe this image.",
    "Describe the image in detail.",
    "What do you see in this picture?",
    "Write a caption for this image.",
)
VIDEO_PROMPTS: tuple[str, ...] = (
    "Describe this video.",
    "What happens in the video?",
    "Describe what happens in this clip.",
)
_GRAMMAR_WORDS = (
    "The image video shows shape shapes on a background . It looks mood is the is a that moves to "
    "from appears disappears stays turns at " + " ".join(ORDINALS)
)
_QA_WORDS = (
    "How many shapes are there ? What color is the background Where is What is at shape Is small or large"
)
_TEMPLATE_WORDS = "user assistant system You are a helpful assistant"

_SEED_MIX = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class Shape:
    """One shape of a scene.

    Attributes:
        kind: One of :data:`KINDS`.
        colour: One of :data:`COLOURS`.
        size: ``"small"`` or ``"large"``.
        cell: Grid cell ``0..8`` in reading order (see :data:`POSITIONS`).
    """

    kind: str
    colour: str
    size: str
    cell: int

    @property
    def position(self) -> str:
        return POSITIONS[self.cell]

    def phrase(self, article: str = "A") -> str:
        return f"{article} {self.size} {self.colour} {self.kind}"


@dataclass(frozen=True)
class Scene:
    """A still picture: shapes in reading order of their cells over a background."""

    background: str
    shapes: tuple[Shape, ...]


@dataclass(frozen=True)
class Track:
    """One shape of a clip and what happens to it.

    Attributes:
        shape: The shape as first seen (its initial colour and its anchor cell: where it starts, appears,
            disappears or stays).
        event: One of :data:`EVENTS`.
        end_cell: Where a ``"moves"`` track ends (same row or column as ``shape.cell``), else ``None``.
        new_colour: The colour a ``"turns"`` track ends with, else ``None``.
    """

    shape: Shape
    event: str
    end_cell: int | None = None
    new_colour: str | None = None

    def cells(self) -> tuple[int, ...]:
        """Every cell the track touches (reserved so tracks never overlap)."""
        if self.end_cell is None:
            return (self.shape.cell,)
        (r0, c0), (r1, c1) = divmod(self.shape.cell, GRID), divmod(self.end_cell, GRID)
        if r0 == r1:
            return tuple(r0 * GRID + c for c in range(min(c0, c1), max(c0, c1) + 1))
        return tuple(r * GRID + c0 for r in range(min(r0, r1), max(r0, r1) + 1))

    def shape_at(self, late: bool) -> Shape | None:
        """The shape as drawn on the clip's first frame (``late=False``) or last frame, ``None`` if absent."""
        if (self.event == "appears" and not late) or (self.event == "disappears" and late):
            return None
        if late and self.event == "moves":
            return replace(self.shape, cell=self.end_cell)
        if late and self.event == "turns":
            return replace(self.shape, colour=self.new_colour)
        return self.shape

    def sentence(self, rank: int) -> str:
        """``The <ordinal> shape is a <size> <colour> <kind> that <event> ... the <cell>.``

        Args:
            rank: The track's index in reading order of the anchor cells (0: ``first``).
        """
        head = f"The {ORDINALS[rank]} shape is {self.shape.phrase('a')} that"
        where = self.shape.position
        if self.event == "moves":
            return f"{head} moves from the {where} to the {POSITIONS[self.end_cell]}."
        if self.event == "turns":
            return f"{head} turns {self.new_colour} at the {where}."
        if self.event == "disappears":
            return f"{head} disappears from the {where}."
        return f"{head} {self.event} at the {where}."


@dataclass(frozen=True)
class Clip:
    """A short video: tracks in reading order of their anchor cells over a background."""

    background: str
    tracks: tuple[Track, ...]
    num_frames: int = NUM_FRAMES


@dataclass
class Example:
    """One testbed example.

    Attributes:
        task: One of :data:`TASKS`.
        seed: The seed it was drawn with.
        prompt: The user's text (the image/video goes before it in the chat turn).
        reference: The reply the world's grammar produced for this seed.
        image: The picture (RGB, ``IMAGE_SIDE`` square) for image tasks, else ``None``.
        video: The clip's frames (``NUM_FRAMES`` RGB pictures) for video tasks, else ``None``.
        scene: The :class:`Scene` or :class:`Clip` behind it.
    """

    task: str
    seed: int
    prompt: str
    reference: str
    image: PIL.Image.Image | None = None
    video: list[PIL.Image.Image] | None = None
    scene: Scene | Clip | None = field(default=None, repr=False)


# ---------------------------------------------------------------------------------------------
# Sampling scenes
# ---------------------------------------------------------------------------------------------
def _rng(task: str, seed: int) -> random.Random:
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}.")
    return random.Random((seed * _SEED_MIX + TASKS.index(task)) % (1 << 64))


def _shapes(rng: random.Random, cells: list[int]) -> tuple[Shape, ...]:
    """Shapes at ``cells`` with distinct (colour, kind) pairs, sorted by cell."""
    used: set[tuple[str, str]] = set()
    shapes = []
    for cell in sorted(cells):
        while True:
            kind, colour = rng.choice(KINDS), rng.choice(list(COLOURS))
            if (colour, kind) not in used:
                break
        used.add((colour, kind))
        shapes.append(Shape(kind=kind, colour=colour, size=rng.choice(list(SIZES)), cell=cell))
    return tuple(shapes)


def sample_scene(rng: random.Random, max_shapes: int = MAX_SHAPES) -> Scene:
    """Draws a still scene: 1..``max_shapes`` shapes in distinct cells."""
    n = rng.randint(1, max_shapes)
    cells = rng.sample(range(GRID * GRID), n)
    return Scene(background=rng.choice(list(BACKGROUNDS)), shapes=_shapes(rng, cells))


def _move_end(rng: random.Random, cell: int, free: set[int]) -> int | None:
    row, col = divmod(cell, GRID)
    ends = [row * GRID + c for c in range(GRID) if c != col] + [
        r * GRID + col for r in range(GRID) if r != row
    ]
    rng.shuffle(ends)
    for end in ends:
        track = Track(Shape("circle", "red", "small", cell), "moves", end_cell=end)
        if all(c in free for c in track.cells()):
            return end
    return None


def sample_clip(rng: random.Random, max_shapes: int = MAX_SHAPES) -> Clip:
    """Draws a clip: 1..``max_shapes`` tracks whose cells never overlap."""
    n = rng.randint(1, max_shapes)
    free = set(range(GRID * GRID))
    anchors: list[tuple[int, str, int | None]] = []
    for _ in range(n):
        cell = rng.choice(sorted(free))
        event = rng.choice(EVENTS)
        end = _move_end(rng, cell, free) if event == "moves" else None
        if event == "moves" and end is None:
            event = "stays"
        track = Track(Shape("circle", "red", "small", cell), event, end_cell=end)
        free -= set(track.cells())
        anchors.append((cell, event, end))
        if not free:
            break
    anchors.sort()
    shapes = _shapes(rng, [a[0] for a in anchors])
    tracks = []
    for shape, (_, event, end) in zip(shapes, anchors, strict=True):
        new_colour = None
        if event == "turns":
            new_colour = rng.choice([c for c in COLOURS if c != shape.colour])
        tracks.append(Track(shape=shape, event=event, end_cell=end, new_colour=new_colour))
    return Clip(background=rng.choice(list(BACKGROUNDS)), tracks=tuple(tracks))


# ---------------------------------------------------------------------------------------------
# Texts
# ---------------------------------------------------------------------------------------------
def _count(n: int, noun: str = "shape") -> str:
    return f"{COUNTS[n]} {noun}" + ("" if n == 1 else "s")


def _looks(rng: random.Random) -> str:
    return "It looks " + " ".join(rng.sample(LOOKS, LOOK_WORDS)) + "."


def _mood(rng: random.Random) -> str:
    return "The mood is " + " ".join(rng.sample(MOODS, rng.randint(*MOOD_WORDS))) + "."


def scene_caption(scene: Scene, rng: random.Random) -> str:
    """The long caption of a still scene (random runs drawn from ``rng``)."""
    parts = [f"The image shows {_count(len(scene.shapes))} on a {scene.background} background."]
    for rank, shape in enumerate(scene.shapes):
        parts.append(f"The {ORDINALS[rank]} shape is {shape.phrase('a')} at the {shape.position}.")
        parts.append(_looks(rng))
    parts.append(_mood(rng))
    return " ".join(parts)


def clip_caption(clip: Clip, rng: random.Random) -> str:
    """The temporal caption of a clip (random runs drawn from ``rng``)."""
    parts = [f"The video shows {_count(len(clip.tracks))} on a {clip.background} background."]
    for rank, track in enumerate(clip.tracks):
        parts.append(track.sentence(rank))
        parts.append(_looks(rng))
    parts.append(_mood(rng))
    return " ".join(parts)


def scene_question(scene: Scene, rng: random.Random) -> tuple[str, str]:
    """One question about a still scene and its exact (short, fully determined) answer.

    The kinds the issue names: count (``How many shapes are there?``), colour (of the background, or of the shape
    of a kind that occurs once) and position (``Where is the red circle?``; colour + kind is unique in a scene).
    """
    shapes = scene.shapes
    kinds = [s.kind for s in shapes]
    kinds_unique = [s for s in shapes if kinds.count(s.kind) == 1]
    options = ["count", "background", "where"] + (["colour"] if kinds_unique else [])
    kind = rng.choice(options)
    shape = rng.choice(shapes)
    if kind == "count":
        return "How many shapes are there?", COUNTS[len(shapes)]
    if kind == "background":
        return "What color is the background?", scene.background
    if kind == "where":
        return f"Where is the {shape.colour} {shape.kind}?", shape.position
    shape = rng.choice(kinds_unique)
    return f"What color is the {shape.kind}?", shape.colour


# ---------------------------------------------------------------------------------------------
# Pictures
# ---------------------------------------------------------------------------------------------
def _draw_shape(draw: object, kind: str, cx: float, cy: float, half: int, fill: tuple[int, int, int]) -> None:
    if kind == "circle":
        draw.ellipse((cx - half, cy - half, cx + half, cy + half), fill=fill)
    elif kind == "square":
        draw.rectangle((cx - half, cy - half, cx + half, cy + half), fill=fill)
    elif kind == "triangle":
        draw.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=fill)
    else:  # diamond
        draw.polygon([(cx, cy - half), (cx + half, cy), (cx, cy + half), (cx - half, cy)], fill=fill)


def _cell_centre(cell: int) -> tuple[float, float]:
    row, col = divmod(cell, GRID)
    step = IMAGE_SIDE / GRID
    return (col + 0.5) * step, (row + 0.5) * step


def _jitter_colour(rng: random.Random, rgb: tuple[int, int, int], amount: int) -> tuple[int, int, int]:
    return tuple(min(255, max(0, v + rng.randint(-amount, amount))) for v in rgb)


def _canvas(background: str, rng: random.Random) -> PIL.Image.Image:
    """The background with its lighting: darker at the top, redder on the left, bluer on the right.

    The lighting tells every image patch where it is, as real scenes do (sky above, floor below), so a small
    vision tower without absolute position embeddings (Qwen2-VL's uses only relative 2-D RoPE) can name positions.
    """
    import numpy as np
    from PIL import Image

    ramp = np.linspace(-1.0, 1.0, IMAGE_SIDE)
    base = np.array(_jitter_colour(rng, BACKGROUNDS[background], 5), dtype=np.float64)
    pixels = np.broadcast_to(base, (IMAGE_SIDE, IMAGE_SIDE, 3)).copy()
    pixels += LIGHT * ramp[:, None, None]  # rows: brightness
    pixels[..., 0] -= LIGHT * ramp[None, :]  # columns: red on the left
    pixels[..., 2] += LIGHT * ramp[None, :]  # columns: blue on the right
    return Image.fromarray(np.clip(pixels, 0, 255).round().astype(np.uint8), "RGB")


def _add_noise(image: PIL.Image.Image, rng: random.Random) -> PIL.Image.Image:
    import numpy as np
    from PIL import Image

    noise = np.random.default_rng(rng.getrandbits(63)).integers(-6, 7, size=(IMAGE_SIDE, IMAGE_SIDE, 3))
    pixels = np.asarray(image).astype(np.int16) + noise
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def render_scene(scene: Scene, rng: random.Random) -> PIL.Image.Image:
    """Draws a still scene (colour jitter, +-2 px position jitter and pixel noise drawn from ``rng``)."""
    from PIL import ImageDraw

    image = _canvas(scene.background, rng)
    draw = ImageDraw.Draw(image)
    for shape in scene.shapes:
        cx, cy = _cell_centre(shape.cell)
        fill = _jitter_colour(rng, COLOURS[shape.colour], 15)
        _draw_shape(
            draw, shape.kind, cx + rng.randint(-2, 2), cy + rng.randint(-2, 2), SIZES[shape.size], fill
        )
    return _add_noise(image, rng)


def render_clip(clip: Clip, rng: random.Random) -> list[PIL.Image.Image]:
    """Draws the frames of a clip; appear/disappear/turn events happen at :data:`CHANGE_FRAME`."""
    from PIL import ImageDraw

    frames_n = clip.num_frames
    base = _canvas(clip.background, rng)
    styles = [
        (_jitter_colour(rng, (0, 0, 0), 15), rng.randint(-2, 2), rng.randint(-2, 2)) for _ in clip.tracks
    ]
    frames = []
    for f in range(frames_n):
        frame = base.copy()
        draw = ImageDraw.Draw(frame)
        late = f >= CHANGE_FRAME
        for track, (tint, dx, dy) in zip(clip.tracks, styles, strict=True):
            shape = track.shape
            if (track.event == "appears" and not late) or (track.event == "disappears" and late):
                continue
            cx, cy = _cell_centre(shape.cell)
            if track.event == "moves":
                ex, ey = _cell_centre(track.end_cell)
                t = f / max(frames_n - 1, 1)
                cx, cy = cx + t * (ex - cx), cy + t * (ey - cy)
            colour = track.new_colour if track.event == "turns" and late else shape.colour
            fill = tuple(min(255, max(0, a + b)) for a, b in zip(COLOURS[colour], tint, strict=True))
            _draw_shape(draw, shape.kind, cx + dx, cy + dy, SIZES[shape.size], fill)
        frames.append(_add_noise(frame, rng))
    return frames


# ---------------------------------------------------------------------------------------------
# Public sampling
# ---------------------------------------------------------------------------------------------
def sample(task: str, seed: int, max_shapes: int = MAX_SHAPES, render: bool = True) -> Example:
    """Draws one example of ``task``; equal ``(task, seed)`` give identical examples.

    Seeds below ``TRAIN_SEED_OFFSET`` (see :mod:`vlmspec.testbed.train`) are never used for training, so
    benchmarks and quality gates drawing small seeds see held-out scenes.

    Args:
        task: One of :data:`TASKS`.
        seed: Any non-negative int.
        max_shapes: At most this many shapes (1..3; training starts with simple scenes).
        render: ``False`` skips drawing (``image``/``video`` are ``None``): the texts and scene alone, cheaply.

    Returns:
        An :class:`Example` with ``image`` (``IMAGE_SIDE`` x ``IMAGE_SIDE`` RGB) for image tasks or ``video``
        (``NUM_FRAMES`` frames) for ``video_caption``.

    Raises:
        ValueError: If ``task`` is unknown, ``seed`` is not a non-negative int or ``max_shapes`` is not 1..3.
    """
    if task not in TASKS:
        raise ValueError(f"Unknown testbed task {task!r}; expected one of {', '.join(TASKS)}.")
    if not 1 <= max_shapes <= MAX_SHAPES:
        raise ValueError(f"max_shapes must be between 1 and {MAX_SHAPES}, got {max_shapes!r}.")
    rng = _rng(task, seed)
    if task == "video_caption":
        clip = sample_clip(rng, max_shapes)
        prompt = rng.choice(VIDEO_PROMPTS)
        caption = clip_caption(clip, rng)
        frames = render_clip(clip, rng) if render else None
        return Example(task, seed, prompt, caption, video=frames, scene=clip)
    scene = sample_scene(rng, max_shapes)
    if task == "image_caption":
        prompt, reference = rng.choice(CAPTION_PROMPTS), scene_caption(scene, rng)
    else:
        prompt, reference = scene_question(scene, rng)
    return Example(
        task, seed, prompt, reference, image=render_scene(scene, rng) if render else None, scene=scene
    )


# ---------------------------------------------------------------------------------------------
# Vocabulary and scoring
# ---------------------------------------------------------------------------------------------
def lexicon() -> list[str]:
    """Every word and punctuation mark the world's texts (prompts and replies) can contain, sorted."""
    text = " ".join(
        [
            _GRAMMAR_WORDS,
            _QA_WORDS,
            _TEMPLATE_WORDS,
            " ".join(KINDS),
            " ".join(COLOURS),
            " ".join(BACKGROUNDS),
            " ".join(SIZES),
            " ".join(POSITIONS),
            " ".join(COUNTS),
            " ".join(LOOKS),
            " ".join(MOODS),
            " ".join(k + "s" for k in KINDS),
            " ".join(CAPTION_PROMPTS + VIDEO_PROMPTS),
        ]
    )
    return sorted(set(reply_words(text)))


_WORD = re.compile(r"\w+|[^\w\s]")


def reply_words(text: str) -> list[str]:
    """A world text split into the words and punctuation marks the testbed tokenizer makes one token each of."""
    return _WORD.findall(text)


_FACT_SHAPE = re.compile(
    r"The \w+ shape is a (small|large) (\w+) (\w+)"
    r"(?: that (stays|appears|disappears|moves|turns (\w+)))? (?:at|from) the ([a-z ]+?)(?: to the ([a-z ]+?))?\."
)
_FACT_HEAD = re.compile(r"The (?:image|video) shows (\w+) shapes? on a (\w+) background\.")


def caption_facts(text: str) -> list[str]:
    """The scene-determined facts of a caption, in order (random runs are ignored).

    Args:
        text: A caption produced by the grammar (or a model imitating it).

    Returns:
        Facts like ``["count=two", "background=gray", "1.position=top left", "1.size=large", "1.colour=red",
        "1.kind=circle", "1.event=is", ...]`` (``event`` is ``is`` for still pictures).
    """
    facts: list[str] = []
    head = _FACT_HEAD.search(text)
    if head:
        facts += [f"count={head.group(1)}", f"background={head.group(2)}"]
    for i, m in enumerate(_FACT_SHAPE.finditer(text), start=1):
        size, colour, kind, event, new_colour, pos, end = m.groups()
        event = (event or "is").split(" ")[0]
        facts += [f"{i}.position={pos}", f"{i}.size={size}", f"{i}.colour={colour}", f"{i}.kind={kind}"]
        facts.append(f"{i}.event={event}")
        if end:
            facts.append(f"{i}.end={end}")
        if new_colour:
            facts.append(f"{i}.new_colour={new_colour}")
    return facts


def fact_accuracy(generated: str, reference: str) -> tuple[int, int]:
    """Scores a caption's scene-determined words against the reference.

    Returns:
        ``(correct, total)``: reference facts found in the generated caption, and the larger of the two
        captions' fact counts (so missing and invented shapes both cost).
    """
    gen, ref = caption_facts(generated), caption_facts(reference)
    correct = len(set(gen) & set(ref))
    return correct, max(len(gen), len(ref), 1)


def write_video(path: str | Path, frames: list[PIL.Image.Image], fps: int = 4) -> Path:
    """Encodes frames (e.g. ``sample("video_caption", s).video``) to an mp4 file with PyAV.

    See :func:`vlmspec.testing.write_video`, which this calls.
    """
    from vlmspec.testing import write_video as _write

    return _write(path, frames, fps=fps)
