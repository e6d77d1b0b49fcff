//go:build !unix

package sim

import "os"

// lockState opens path+".lock" without locking it: the sim runs where NVML
// does, on Linux, and elsewhere only in tests that use one process.
func lockState(path string) (*os.File, error) {
	return os.OpenFile(path+".lock", os.O_RDWR|os.O_CREATE, 0o644)
}
