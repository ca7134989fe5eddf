"""A zoo of real training workloads, built by name at paper size or tiny, on real or fake tensors.

``remat.zoo.names()`` lists them; ``model, inputs, loss_fn = remat.zoo.build("bert-large",
batch=16, seq=512, fake=True)`` builds one; ``remat.trace.capture(model, inputs, loss_fn)`` traces
its step. GPT-2, BERT and ViT come from ``transformers`` configs (random weights, no download);
ResNet-50, DenseNet-121, U-Net and the BiLSTM tagger are defined here, one file each.
"""

from remat.zoo import bilstm, densenet, huggingface, resnet, unet  # noqa: F401  (each registers itself)
from remat.zoo.registry import Workload, ZooModel, build, get, names

__all__ = ["Workload", "ZooModel", "build", "get", "names"]
