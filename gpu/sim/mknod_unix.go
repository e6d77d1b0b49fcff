//go:build unix

package sim

import "golang.org/x/sys/unix"

// mknodChar makes a character device node (mode 0600 before chmod).
func mknodChar(path string, major, minor uint32) error {
	return unix.Mknod(path, unix.S_IFCHR|0o600, int(unix.Mkdev(major, minor)))
}
