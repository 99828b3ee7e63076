// cuda_runtime_api.h for the SIMT executor build (csrc/simt/): the CPU twin stands in for CUDA's header.
#pragma once

#include "../cuda_twin.h"
