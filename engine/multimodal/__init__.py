"""Images in prompts: decoding them safely, encoding them with a vision-language model's own vision
tower, and placing the embeddings at their placeholder positions (`vision.VisionModel`)."""
