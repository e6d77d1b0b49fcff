//go:build unix

package sim

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
)

// lockState takes an exclusive flock on path+".lock" and records the pid
// in it. Two live processes on one state file would each hold their own
// copy of the "hardware" and overwrite each other's changes, so the second
// is refused; the kernel drops the lock when a process dies, so an agent
// restarted after kill -9 gets it at once. The lock is on a file of its own
// because writes replace the state file by rename, which would leave a lock
// on the old inode.
func lockState(path string) (*os.File, error) {
	name := path + ".lock"
	f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			holder := "another process"
			if b, err := os.ReadFile(name); err == nil && len(strings.TrimSpace(string(b))) > 0 {
				holder = "process " + strings.TrimSpace(string(b))
			}
			return nil, fmt.Errorf("in use by %s (lock %s)", holder, name)
		}
		return nil, fmt.Errorf("lock %s: %w", name, err)
	}
	// The pid only makes the error above more helpful; the flock is the lock.
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return f, nil
}
