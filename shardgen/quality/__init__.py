"""Fidelity: what a lossy setting (``fp8``, ``first_block_cache``) costs against the lossless run of the same plan.

- metrics.py: PSNR and SSIM of two images (or two videos, frame by frame).
- lpips.py: LPIPS (v0.1, AlexNet) in plain torch, with weight files the user gives; batches of frames.
- compare.py: a run against a reference run of the same prompts, seeds and sizes, sample by sample
  (``python -m jobs.compare``; LPIPS and CLIP scores when given weights), written into the run as ``compare.json``
  (a bounded summary, for ``jobs.report``) and ``compare_samples.jsonl`` (every sample's figures).
- gate.py: the in-job calibration (``quality.calibrate``): the first samples made losslessly and lossily, and the
  job stopped (or made lossless) before it spends the run when they differ by more than the thresholds.
"""
