"""Data: Convert to Image Directory (input sources), Split, Init / Apply Image Transformation, and
DVC versions of every data set; the ImageDirectory contract and the image checks they share."""
