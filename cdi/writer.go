package cdi

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/gpu-agent/gpu-agent/atomicfile"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
	specs "tags.cncf.io/container-device-interface/specs-go"
)

// DefaultDir is where the agent writes its specs: /var/run/cdi is the
// directory runtimes read last, for specs that live as long as the boot,
// and it outranks /etc/cdi.
const DefaultDir = "/var/run/cdi"

// NodeSpec is the name of the node's spec file (the GPUs and MIG devices);
// claim specs are NodeSpec + "-claim-<uid>".
const NodeSpec = "gpu-agent"

// Writer keeps the agent's spec files in one directory: each written
// atomically (a runtime never reads half a spec), rewritten only when its
// content changes, and files of the agent's that are no longer wanted
// removed.
type Writer struct {
	dir string
	// last is the content of each spec file written, by name.
	last map[string][]byte
}

// NewWriter returns a writer for dir, which the first write creates if
// missing (an agent that never needs a spec never touches the directory).
func NewWriter(dir string) (*Writer, error) {
	if dir == "" {
		return nil, errors.New("cdi: no spec directory")
	}
	return &Writer{dir: dir, last: map[string][]byte{}}, nil
}

// Dir is the directory the writer keeps.
func (w *Writer) Dir() string { return w.dir }

// Path is the file spec name is written to.
func (w *Writer) Path(name string) string { return filepath.Join(w.dir, name+".json") }

// Write writes spec s as name, unless the file already holds it; a nil s
// removes the file. It reports whether the file changed.
func (w *Writer) Write(name string, s *specs.Spec) (bool, error) {
	if s == nil {
		return w.remove(name)
	}
	data, err := json.Marshal(s)
	if err != nil {
		return false, fmt.Errorf("cdi: spec %s: %w", name, err)
	}
	if prev, ok := w.last[name]; ok && bytes.Equal(prev, data) {
		// Unchanged, unless someone removed the file meanwhile (a runtime
		// would then fail every container given one of its names).
		if _, err := os.Stat(w.Path(name)); err == nil {
			return false, nil
		}
	}
	if old, err := os.ReadFile(w.Path(name)); err == nil && bytes.Equal(old, data) {
		w.last[name] = data // written by an earlier run of the agent
		return false, nil
	}
	// The CDI library reads the file back before it replaces the old one:
	// a spec it would refuse never reaches a runtime.
	check := func(tmp string) error { _, err := cdiapi.ReadSpec(tmp, 0); return err }
	err = os.MkdirAll(w.dir, 0o755)
	if err == nil {
		err = atomicfile.Write(w.Path(name), data, atomicfile.Options{Check: check})
	}
	if err != nil {
		return false, fmt.Errorf("cdi: spec %s: %w", w.Path(name), err)
	}
	w.last[name] = data
	return true, nil
}

func (w *Writer) remove(name string) (bool, error) {
	delete(w.last, name)
	err := os.Remove(w.Path(name))
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("cdi: %w", err)
	}
	return true, nil
}

// RemoveStale removes the agent's spec files (NodeSpec and its claim specs)
// other than keep, and returns the names removed. Another vendor's or
// tool's specs in the directory are never touched.
func (w *Writer) RemoveStale(keep func(name string) bool) ([]string, error) {
	entries, err := os.ReadDir(w.dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("cdi: %w", err)
	}
	var removed []string
	var errs []error
	for _, e := range entries {
		name, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || !e.Type().IsRegular() || (name != NodeSpec && !strings.HasPrefix(name, NodeSpec+"-claim-")) || keep(name) {
			continue
		}
		if _, err := w.remove(name); err != nil {
			errs = append(errs, err)
			continue
		}
		removed = append(removed, name)
	}
	return removed, errors.Join(errs...)
}
