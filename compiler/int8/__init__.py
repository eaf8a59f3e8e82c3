"""INT8 on the host: ``quantize`` (an fp32 model + calibration inputs -> a QDQ model, onnxruntime's
quantizer), ``calibration`` (images or a video read and preprocessed as the device will),
``accuracy`` (the judge: a bundle against its fp32 model on held-out images) and ``agreement``
(the numbers that judge uses: top-1/top-5, SQNR, cosine, and their verdict)."""
