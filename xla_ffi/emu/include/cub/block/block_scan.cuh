// Host stand-in for CUB's <cub/block/block_scan.cuh> (the CUDA emulator build).
#pragma once

#include "cuda_emu/cub.h"
