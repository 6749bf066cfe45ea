"""Everything that runs on a GPU node: encodings, the model, training and evaluation."""
