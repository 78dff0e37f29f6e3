// Host stand-in for CUB's <cub/device/device_scan.cuh> (the CUDA emulator build).
#pragma once

#include "cuda_emu/cub.h"
