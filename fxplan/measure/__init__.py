"""Stage 2, measurement: peak bytes and time of one training step (fake, CPU, CUDA), kernel scratch."""
