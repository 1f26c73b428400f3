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
    """A training image size that grows with the epoch: FFCV's progressive resizing schedule.

    START px up to and including epoch `from_epoch`, END px from epoch `to_epoch` on, and in between the
    straight line from (`from_epoch`, START) to (`to_epoch`, END) rounded to the nearest multiple of 32 px
    (halves to even) and kept within [START, END]. Epochs count from 0; the size depends on the epoch alone,
    so a resumed run trains at the size an uninterrupted one would have. Written as text
    `"START:END:FROM_EPOCH:TO_EPOCH"` (`dali-train --progressive-resize`); FFCV's ResNet-50 recipes use
    `"160:192:65:76"` for 88 epochs.

    Example:
        ```python
        from dalifeed.pipelines import ProgressiveResize

        schedule = ProgressiveResize.parse("160:192:65:76")
        schedule.size(70)  # 176
        ```

    Attributes:
        start: The size in px of the first epochs, at least 8.
        end: The size in px of the last epochs, at least `start`.
        from_epoch: The last epoch (0-based) at `start`; the ramp begins after it.
        to_epoch: The first epoch at `end`, at least `from_epoch`.

    Raises:
        ValueError: Sizes or epochs out of order, named.
    """

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
        """The schedule a text such as `"160:192:65:76"` writes.

        Args:
            text: `"START:END:FROM_EPOCH:TO_EPOCH"`, or with `epochs` given, `"START:END"`, which ramps over
                the whole run, from epoch 0 to epoch `epochs - 1`.
            epochs: The run's epochs, needed for `"START:END"`; None: only the four-number form is read.
                Default None.

        Raises:
            ValueError: The text is not such a schedule (one line, naming it).
        """
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
        """The training image size in px of an epoch.

        Between the ramp's ends the size is rounded to a multiple of 32 and kept within [START, END] (FFCV
        does not clamp: with START and END multiples of 32 this changes nothing, but 100:140 would otherwise
        train at 96 px).

        Args:
            epoch: The epoch, counted from 0.
        """
        if epoch <= self.from_epoch:
            return self.start
        if epoch >= self.to_epoch:
            return self.end
        # np.interp's arithmetic (slope first), so that halves round as FFCV's do
        slope = (self.end - self.start) / (self.to_epoch - self.from_epoch)
        line = slope * (epoch - self.from_epoch) + self.start
        return min(self.end, max(self.start, round(line / STEP) * STEP))

    def sizes(self, epochs: int) -> dict[int, list[int]]:
        """Each size a run trains at, with the epochs it trains at it.

        Args:
            epochs: The run's number of epochs.

        Returns:
            size in px -> the epochs at that size, in order.
        """
        by_size: dict[int, list[int]] = {}
        for epoch in range(epochs):
            by_size.setdefault(self.size(epoch), []).append(epoch)
        return by_size

    def beyond(self, epochs: int) -> str | None:
        """What of the schedule a run never reaches, in words: a ramp that ends after the run's last epoch
        stops short of END.

        Args:
            epochs: The run's number of epochs.

        Returns:
            A sentence for a warning, or None when the whole schedule fits in the run.
        """
        last = epochs - 1
        if self.start == self.end or self.to_epoch <= last:
            return None
        reached = self.size(last)
        return (f"its ramp to {self.end} px (epochs {self.from_epoch}-{self.to_epoch}) ends after the run's last epoch "
                f"{last}: the run trains up to {reached} px" + (" only" if reached == self.start else ""))

    def describe(self, epochs: int) -> str:
        """The schedule in words, e.g. "epochs 0-64: 160 px, 65-87: 192 px".

        Args:
            epochs: The run's number of epochs.
        """
        spans = []
        for size, at in self.sizes(epochs).items():
            spans.append(f"{at[0]}-{at[-1]}: {size} px" if len(at) > 1 else f"{at[0]}: {size} px")
        return "epochs " + ", ".join(spans)
