"""Images in the conversation (issue 24): decoding and limits, content parts, media hashing,
the vision tower and its encoder-output cache. See docs/vision.md."""
