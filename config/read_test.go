package config

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// hostileFile makes path something ReadFile must refuse, and returns what
// the refusal must say besides the path.
type hostileFile struct {
	name   string
	make   func(t *testing.T, path string)
	reason string
}

func hostileFiles() []hostileFile {
	return []hostileFile{
		{"oversized", func(t *testing.T, path string) {
			must(t, os.WriteFile(path, make([]byte, MaxBytes+1), 0o644))
		}, strconv.Itoa(MaxBytes+1) + " bytes exceeds the maximum of " + strconv.Itoa(MaxBytes) + " bytes"},
		{"symlink to /dev/zero", func(t *testing.T, path string) {
			must(t, os.Symlink("/dev/zero", path))
		}, "not a regular file (a character device)"},
		{"FIFO", func(t *testing.T, path string) {
			must(t, syscall.Mkfifo(path, 0o644))
		}, "not a regular file (a named pipe)"},
		{"directory", func(t *testing.T, path string) {
			must(t, os.Mkdir(path, 0o755))
		}, "not a regular file (a directory)"},
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// readWithin runs ReadFile, failing the test if it blocks: on a FIFO
// without a writer a plain open would never return.
func readWithin(t *testing.T, path string) ([]byte, error) {
	t.Helper()
	type result struct {
		data []byte
		err  error
	}
	done := make(chan result, 1)
	go func() {
		data, err := ReadFile(path)
		done <- result{data, err}
	}()
	select {
	case r := <-done:
		return r.data, r.err
	case <-time.After(5 * time.Second):
		t.Fatalf("ReadFile(%s) blocked", path)
		return nil, nil
	}
}

func TestReadFileRefuses(t *testing.T) {
	for _, h := range hostileFiles() {
		t.Run(h.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "config.yaml")
			h.make(t, path)
			data, err := readWithin(t, path)
			if err == nil {
				t.Fatalf("read %d bytes, want an error", len(data))
			}
			if msg := err.Error(); !strings.Contains(msg, path) || !strings.Contains(msg, h.reason) {
				t.Errorf("err = %q, want it to name %s and say %q", msg, path, h.reason)
			}
			if !strings.Contains(err.Error(), strconv.Itoa(MaxBytes)) {
				t.Errorf("err = %q, want it to name the bound %d", err, MaxBytes)
			}
			// Load reads the same way.
			if _, _, lerr := Load(path); lerr == nil || lerr.Error() != err.Error() {
				t.Errorf("Load err = %v, want %v", lerr, err)
			}
		})
	}
}

func TestReadFile(t *testing.T) {
	dir := t.TempDir()
	atLimit := filepath.Join(dir, "at-limit.yaml")
	content := make([]byte, MaxBytes)
	content[MaxBytes-1] = 'x'
	must(t, os.WriteFile(atLimit, content, 0o644))
	data, err := ReadFile(atLimit)
	if err != nil || len(data) != MaxBytes || data[MaxBytes-1] != 'x' {
		t.Fatalf("file of exactly MaxBytes: %d bytes, %v", len(data), err)
	}

	// Through a symlink, as a ConfigMap key is mounted.
	link := filepath.Join(dir, "link.yaml")
	must(t, os.Symlink("at-limit.yaml", link))
	if data, err := ReadFile(link); err != nil || len(data) != MaxBytes {
		t.Fatalf("through a symlink: %d bytes, %v", len(data), err)
	}

	missing := filepath.Join(dir, "missing.yaml")
	_, err = ReadFile(missing)
	if !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), missing) {
		t.Errorf("missing file: err = %v, want not-exist naming %s", err, missing)
	}
}
