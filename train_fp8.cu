// train_fp8.cu: main (stub until the training loop lands): prints the device and exits.
#include "fp8_kernels.cuh"
int main() {
    int n = 0;
    cudaCheck(cudaGetDeviceCount(&n));
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    printf("%s\n", prop.name);
    return 0;
}
