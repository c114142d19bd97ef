"""``pb_utils.Tensor.from_dlpack`` of a CUDA tensor (needs a GPU and a CUDA build of torch):
kiln's Python backend holds tensors in host memory, so the tensor is copied there."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.backends.python.pb_utils import Tensor

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("as_capsule", [True, False], ids=["capsule", "protocol"])
def test_a_cuda_tensor_is_copied_to_the_host(as_capsule: bool) -> None:
    import torch
    import torch.utils.dlpack as tdl

    assert torch.cuda.is_available(), "a CUDA build of torch is needed for the GPU path"
    source = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4) * 0.5
    given = tdl.to_dlpack(source) if as_capsule else source
    tensor = Tensor.from_dlpack("OUT", given)
    got = tensor.as_numpy()
    assert tensor.is_cpu() and isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, source.cpu().numpy())
    # A bfloat16 CUDA tensor arrives as float32, as kiln holds TYPE_BF16.
    half = Tensor.from_dlpack("B", source.to(torch.bfloat16)).as_numpy()
    assert half.dtype == np.float32 and half[0].tolist() == [0.0, 0.5, 1.0, 1.5]
