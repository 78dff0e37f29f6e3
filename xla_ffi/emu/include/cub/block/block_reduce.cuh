// Host stand-in for CUB's <cub/block/block_reduce.cuh> (the CUDA emulator build).
#pragma once

#include "cuda_emu/cub.h"
