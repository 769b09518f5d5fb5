"""Training NECTAR modules (the ``train`` stage's machinery): targets data, losses, schedule,
the loop with NaN masking and bit-for-bit resumable checkpoints, and torchrun data parallelism."""
