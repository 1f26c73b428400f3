"""Progressive resizing: the training image size as a function of the epoch (FFCV's lever).

FFCV's ImageNet recipes train at a size that grows over the run and evaluate at a larger one (Touvron et al.,
"Fixing the train-test resolution discrepancy"). `ProgressiveResize` is their schedule, `get_resolution` of
libffcv/ffcv-imagenet's train_imagenet.py: START up to and including epoch FROM_EPOCH, END from epoch TO_EPOCH on,
and in between the straight line from (FROM_EPOCH, START) to (TO_EPOCH, END) rounded to the nearest multiple
of 32 px (halves to even, as numpy's `np.round`). Its rn50 configurations use 160:192:65:76 for 88 epochs.

The size is a pure function of the epoch (epochs counted from 0, as the loader and FFCV count them), so a run
resumed at epoch e, at its start or in its middle, trains at the size an uninterrupted run would have.
"""

from __future__ import annotations

from dataclasses import dataclass

STEP = 32  # sizes between START and END are multiples of this (FFCV's `/ 32) * 32`)


@dataclass(frozen=True)
class ProgressiveResize:
    """START:END:FROM_EPOCH:TO_EPOCH (see the module docstring)."""

    start: int
    end: int
    from_epoch: int
    to_epoch: int

    def __post_init__(self) -> None:
        if self.start < 8:
            raise ValueError(f"START must be >= 8 px, got {self.start}")
        if self.end < self.start:
            raise ValueError(f"END {self.end} must be >= START {self.start} (the size grows)")
        if not 0 <= self.from_epoch <= self.to_epoch:
            raise ValueError(f"FROM_EPOCH {self.from_epoch} and TO_EPOCH {self.to_epoch} must satisfy "
                             f"0 <= FROM_EPOCH <= TO_EPOCH")

    @classmethod
    def parse(cls, text: str, epochs: int | None = None) -> ProgressiveResize:
        """'START:END:FROM_EPOCH:TO_EPOCH', or 'START:END', which ramps over the whole run: from epoch 0 to the
        last one, `epochs - 1`. ValueError (one line, naming the text) when it is not such a schedule."""
        parts = text.split(":")
        try:
            numbers = [int(p) for p in parts]
        except ValueError:
            numbers = []
        if len(numbers) == 2 and epochs is not None:
            numbers += [0, max(epochs - 1, 0)]
        if len(numbers) != 4:
            form = ("START:END or " if epochs is not None else "") + "START:END:FROM_EPOCH:TO_EPOCH"
            raise ValueError(f"expected {form} in whole numbers, such as 160:192:65:76, got {text!r}")
        try:
            return cls(*numbers)
        except ValueError as e:
            raise ValueError(f"{text}: {e}") from None

    def __str__(self) -> str:
        return f"{self.start}:{self.end}:{self.from_epoch}:{self.to_epoch}"

    def size(self, epoch: int) -> int:
        """The training image size of epoch `epoch`. Between the ramp's ends, FFCV rounds to a multiple of 32;
        the result is kept within [START, END] (FFCV does not clamp: with START and END multiples of 32, as in
        its configurations, clamping changes nothing, but 100:140 would otherwise train at 96 px)."""
        if epoch <= self.from_epoch:
            return self.start
        if epoch >= self.to_epoch:
            return self.end
        # np.interp's arithmetic (slope first), so that halves round as FFCV's do
        slope = (self.end - self.start) / (self.to_epoch - self.from_epoch)
        line = slope * (epoch - self.from_epoch) + self.start
        return min(self.end, max(self.start, round(line / STEP) * STEP))

    def sizes(self, epochs: int) -> dict[int, list[int]]:
        """Each size the first `epochs` epochs train at -> those epochs, in order."""
        by_size: dict[int, list[int]] = {}
        for epoch in range(epochs):
            by_size.setdefault(self.size(epoch), []).append(epoch)
        return by_size

    def beyond(self, epochs: int) -> str | None:
        """What of the schedule a run of `epochs` epochs never reaches, in words (None: it all fits): a ramp
        that ends after the run's last epoch (or starts there) stops short of END."""
        last = epochs - 1
        if self.start == self.end or self.to_epoch <= last:
            return None
        reached = self.size(last)
        return (f"its ramp to {self.end} px (epochs {self.from_epoch}-{self.to_epoch}) ends after the run's last epoch "
                f"{last}: the run trains up to {reached} px" + (" only" if reached == self.start else ""))

    def describe(self, epochs: int) -> str:
        """'epochs 0-64: 160 px, 65-87: 192 px' for a run of `epochs` epochs."""
        spans = []
        for size, at in self.sizes(epochs).items():
            spans.append(f"{at[0]}-{at[-1]}: {size} px" if len(at) > 1 else f"{at[0]}: {size} px")
        return "epochs " + ", ".join(spans)
