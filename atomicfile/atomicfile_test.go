package atomicfile

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

func TestWriteReplacesWholeFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "state.json")
	if err := Write(filepath.Join(dir, "gone", "x"), nil); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("Write into a missing directory = %v, want ErrNotExist", err)
	}
	if err := Write(path, []byte("old")); err != nil {
		t.Fatal(err)
	}
	if err := Write(path, []byte("new content"), Options{Perm: 0o600}); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(path)
	if err != nil || string(got) != "new content" {
		t.Fatalf("content %q, %v", got, err)
	}
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v, %v", fi.Mode(), err)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Fatalf("temporary files left: %v", entries)
	}
}

func TestWriteCheckRefusalKeepsOld(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "spec.json")
	if err := Write(path, []byte("good")); err != nil {
		t.Fatal(err)
	}
	refused := errors.New("invalid spec")
	var checked string
	err := Write(path, []byte("bad"), Options{Check: func(tmp string) error {
		b, _ := os.ReadFile(tmp)
		checked = string(b)
		return refused
	}})
	if !errors.Is(err, refused) {
		t.Fatalf("Write = %v, want the check's error", err)
	}
	if checked != "bad" {
		t.Fatalf("check saw %q, want the new content", checked)
	}
	got, _ := os.ReadFile(path)
	if string(got) != "good" {
		t.Fatalf("content %q after a refused write, want the old", got)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 1 {
		t.Fatalf("temporary files left: %v", entries)
	}
}

func TestReadFileRefuses(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	big := filepath.Join(dir, "big")
	if err := os.WriteFile(big, make([]byte, 11), 0o644); err != nil {
		t.Fatal(err)
	}
	ok := filepath.Join(dir, "ok")
	if err := os.WriteFile(ok, []byte("0123456789"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		path string
		want error
		msg  string
	}{
		{fifo, ErrNotRegular, "a named pipe"},
		{dir, ErrNotRegular, "a directory"},
		{"/dev/zero", ErrNotRegular, "a character device"},
		{big, ErrTooLarge, "11 bytes exceeds the maximum of 10 bytes"},
		{filepath.Join(dir, "missing"), os.ErrNotExist, "no such file"},
	} {
		_, err := ReadFile(tc.path, 10)
		if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("ReadFile(%s) = %v, want %v saying %q", tc.path, err, tc.want, tc.msg)
		}
	}
	if b, err := ReadFile(ok, 10); err != nil || string(b) != "0123456789" {
		t.Fatalf("ReadFile at the limit = %q, %v", b, err)
	}
}

// A file set aside keeps its bytes under the new name, replacing one set
// aside before, and the error says why and where; one that cannot be moved
// is left where it is, and the error says so.
func TestSetAside(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "checkpoint.json")
	why := errors.New("torn")
	for _, content := range []string{"first", "second"} {
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		aside, err := SetAside(path, why)
		if aside != path+".unreadable" || !errors.Is(err, why) || err.Error() != path+": torn; set aside as "+aside {
			t.Fatalf("SetAside = %q, %v", aside, err)
		}
		if b, err := os.ReadFile(aside); err != nil || string(b) != content {
			t.Fatalf("set aside: %q, %v; want %q", b, err, content)
		}
		if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("%s still there: %v", path, err)
		}
	}
	aside, err := SetAside(filepath.Join(dir, "gone"), why)
	if aside != "" || !errors.Is(err, why) || !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), "and setting it aside: rename ") {
		t.Fatalf("SetAside of a missing file = %q, %v", aside, err)
	}
}
