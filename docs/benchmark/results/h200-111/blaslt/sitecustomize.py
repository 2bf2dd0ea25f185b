import os
if os.environ.get("X_BLASLT"):
    import sys
    import torch
    torch.backends.cuda.preferred_blas_library("cublaslt")
    with open("/tmp/blaslt.txt", "a") as f:
        f.write(f"{os.getpid()} {sys.argv[:2]}\n")
