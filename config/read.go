package config

import (
	"fmt"
	"io"
	"os"
	"syscall"
)

// MaxBytes is the largest config this package reads. The file is delivered
// as a ConfigMap key, and the API server refuses a ConfigMap whose data
// exceeds 1 MiB, so nothing legitimate is larger; a bigger input is a
// mistake or an attack, and parsing costs memory in proportion to its size.
const MaxBytes = 1 << 20

// MaxReplicas bounds replicas of one time-slicing or MPS entry. Every
// replica is a device ID held in the catalog and sent in full on each
// ListAndWatch update, so the bound keeps that list (devices × replicas)
// within one gRPC message at the default 4 MiB limit even on a node of 56
// MIG devices (8 GPUs × 7), about 66 bytes a replica on the wire. 1024 is
// still far above any useful value: sharing
// one device between more containers than a node runs pods (the kubelet's
// default maxPods is 110) buys nothing, and MPS serves at most 48 clients
// per GPU.
const MaxReplicas = 1024

// ReadFile reads a config file of at most MaxBytes, following symlinks (a
// mounted ConfigMap key is one). Anything but a regular file is refused
// without reading from it: a FIFO would block the reader until a writer
// appears, and a device such as /dev/zero never ends. The file is opened
// non-blocking so that opening a FIFO cannot block either.
func ReadFile(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("config %s: not a regular file (%s); only regular files of at most %d bytes are read",
			path, fileKind(fi.Mode()), MaxBytes)
	}
	if fi.Size() > MaxBytes {
		return nil, tooLarge(path, fi.Size())
	}
	// The size can change between Stat and read (a file being rewritten),
	// so the read itself is bounded too; one byte more than allowed tells a
	// file at the limit from one over it.
	data, err := io.ReadAll(io.LimitReader(f, MaxBytes+1))
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	if len(data) > MaxBytes {
		return nil, tooLarge(path, -1)
	}
	return data, nil
}

func tooLarge(path string, size int64) error {
	if size < 0 {
		return fmt.Errorf("config %s: larger than the maximum of %d bytes (a ConfigMap's limit)", path, MaxBytes)
	}
	return fmt.Errorf("config %s: %d bytes exceeds the maximum of %d bytes (a ConfigMap's limit)", path, size, MaxBytes)
}

// fileKind names a non-regular file type for error messages.
func fileKind(m os.FileMode) string {
	switch {
	case m.IsDir():
		return "a directory"
	case m&os.ModeNamedPipe != 0:
		return "a named pipe"
	case m&os.ModeSocket != 0:
		return "a socket"
	case m&os.ModeCharDevice != 0:
		return "a character device"
	case m&os.ModeDevice != 0:
		return "a block device"
	}
	return "mode " + m.Type().String()
}
