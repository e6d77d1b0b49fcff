// Package atomicfile writes the files gpu-agent keeps state in so that a
// crash leaves the old content or the new, never a mix, and reads them back
// without trusting what is on disk: only regular files, of bounded size.
package atomicfile

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"
)

// Options adjust Write.
type Options struct {
	// Perm is the file's mode (default 0o644: the files are read by other
	// processes, the container runtime or mps-host among them).
	Perm os.FileMode
	// Check, when set, is given the temporary file once its content is on
	// disk and before it replaces path; an error leaves path as it was.
	// Validators that only read files (the CDI library's) use it.
	Check func(tmp string) error
}

// Write replaces path with data: a temporary file in the same directory
// (a rename must not cross file systems), fsync, rename over path, then an
// fsync of the directory so the rename itself survives a power cut. The
// directory must exist: one that vanished is an error, not made again. The temporary file's name starts with a
// dot and never equals path's, so watchers that filter on the final name
// ignore it; it is removed on any failure.
func Write(path string, data []byte, opts ...Options) error {
	if err := write(path, data, opts...); err != nil {
		// Named by the file meant, not the temporary one: the message is
		// the same for every attempt, so a caller can tell a new error.
		return fmt.Errorf("write %s: %w", path, withoutPath(err))
	}
	return nil
}

func write(path string, data []byte, opts ...Options) error {
	var o Options
	if len(opts) > 0 {
		o = opts[0]
	}
	if o.Perm == 0 {
		o.Perm = 0o644
	}
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp) // fails harmlessly after the rename
	_, err = f.Write(data)
	if err == nil {
		err = f.Chmod(o.Perm)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil && o.Check != nil {
		err = o.Check(tmp)
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		return err
	}
	return SyncDir(dir)
}

// SyncDir makes the entries of dir (a file created, renamed or removed in
// it) durable. File systems that cannot sync a directory say EINVAL; that
// is no error here, as there is nothing more to do on them.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("sync directory: %w", err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil && !errors.Is(err, os.ErrInvalid) && !errors.Is(err, syscall.EINVAL) {
		return fmt.Errorf("sync directory %s: %w", dir, err)
	}
	return nil
}

// ErrNotRegular is wrapped by ReadFile's error for anything but a regular
// file.
var ErrNotRegular = errors.New("not a regular file")

// ErrTooLarge is wrapped by ReadFile's error for a file over its limit.
var ErrTooLarge = errors.New("file too large")

// ReadFile reads path, following symlinks, if it is a regular file of at
// most max bytes. Anything else is refused without reading from it: a FIFO
// would block the reader until a writer appears (opening it is
// non-blocking, so that cannot block either), and a device such as
// /dev/zero never ends. The error wraps os.ErrNotExist for a missing file,
// ErrNotRegular or ErrTooLarge; it does not name path (callers do).
func ReadFile(path string, max int64) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, withoutPath(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, withoutPath(err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%w (%s)", ErrNotRegular, Kind(fi.Mode()))
	}
	if fi.Size() > max {
		return nil, fmt.Errorf("%w: %d bytes exceeds the maximum of %d bytes", ErrTooLarge, fi.Size(), max)
	}
	// The size can change between Stat and read (a file being rewritten),
	// so the read itself is bounded too; one byte more than allowed tells a
	// file at the limit from one over it.
	data, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, withoutPath(err)
	}
	if int64(len(data)) > max {
		return nil, fmt.Errorf("%w: larger than the maximum of %d bytes", ErrTooLarge, max)
	}
	return data, nil
}

// withoutPath drops the path an *os.PathError repeats: callers name the
// file once, in their own words. errors.Is(err, fs.ErrNotExist) still holds.
func withoutPath(err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return fmt.Errorf("%s: %w", pe.Op, pe.Err)
	}
	return err
}

// Kind names a file type for error messages ("a named pipe").
func Kind(m os.FileMode) string {
	switch {
	case m.IsRegular():
		return "a regular file"
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

// SetAside moves path, a file of state that cannot be trusted for the
// reason why, out of the way of the next start: renamed to
// path+".unreadable" in its directory (replacing one set aside before), so
// that the next start does not trip over it again and a person can look at
// it. The error names the file, why, and where it went; aside is "" when
// it could not be moved, and the error says that too.
func SetAside(path string, why error) (aside string, err error) {
	aside = path + ".unreadable"
	if rerr := os.Rename(path, aside); rerr != nil {
		return "", fmt.Errorf("%s: %w (and setting it aside: %w)", path, why, rerr)
	}
	return aside, fmt.Errorf("%s: %w; set aside as %s", path, why, aside)
}
