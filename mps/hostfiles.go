package mps

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/gpu-agent/gpu-agent/atomicfile"
)

// The agent and `gpu-agent mps-host` run in different containers (so that an
// agent upgrade does not take the daemons, and every MPS client, down with
// the agent's container) and talk through two files in the MPS root, a host
// directory both mount:
//
//   - DesiredFileName, written by the agent (Remote.Set): the daemons to run.
//   - HealthFileName, written by mps-host (Host): how each daemon is doing,
//     rewritten every interval as a heartbeat.
//
// Each side only ever writes its own file, and always atomically
// (atomicfile.Write), so a reader sees a whole old or a whole new file.
const (
	DesiredFileName = "desired.json"
	HealthFileName  = "health.json"
	// FileVersion is the version of both formats. A reader refuses another
	// version, and unknown fields: mps-host is rarely upgraded, and running
	// daemons without a setting a newer agent asked for would be silently
	// wrong, while a refusal shows (the replicas turn unhealthy, saying why).
	FileVersion = 1
	// maxHostFileBytes bounds what is read from either file; a few thousand
	// devices fit many times over.
	maxHostFileBytes = 4 << 20
	// maxHostFileValues bounds the JSON values either file may hold, counted
	// as the ',', '{' and '[' that separate or open them: a daemon or a
	// device's health takes 5, so some 3,000 devices fit. It is checked
	// before decoding, as encoding/json makes an item of every list or map
	// entry, even after a type error: 4 MiB of "{}," cost over 500 MB.
	maxHostFileValues = 1 << 14
	// maxDaemons bounds a daemon list (16 GPUs of 7 MIG devices are 112),
	// so that desired.json and health.json stay within maxHostFileValues.
	maxDaemons = 1024
)

// DesiredFile is the content of DesiredFileName.
type DesiredFile struct {
	Version int `json:"version"`
	// Generation goes up by one with each change of Daemons; health.json
	// says which generation mps-host has taken in and what each daemon
	// carries.
	Generation int64    `json:"generation"`
	Daemons    []Daemon `json:"daemons"`
}

// HealthFile is the content of HealthFileName.
type HealthFile struct {
	Version int `json:"version"`
	// Written is when mps-host wrote the file; it rewrites it every
	// Interval, so an old Written means mps-host is gone or hung.
	Written  time.Time `json:"written"`
	Interval Duration  `json:"interval"`
	// PID is mps-host's process id, for messages.
	PID int `json:"pid"`
	// Generation is the generation of desired.json mps-host runs (0: none
	// read yet, so it touches no daemon).
	Generation int64 `json:"generation"`
	// Rejected says why the current desired.json was not taken in ("" when
	// it was); mps-host keeps running the last good one meanwhile.
	Rejected string `json:"rejected,omitempty"`
	// Stopped: mps-host ended and wrote this as its last word. In a pod its
	// daemons end with its container, so they count as gone.
	Stopped bool `json:"stopped,omitempty"`
	// Devices are the daemons of generation Generation, by device UUID.
	Devices map[string]DeviceHealth `json:"devices"`
}

// DeviceHealth is one daemon's state in HealthFile.
type DeviceHealth struct {
	Healthy bool   `json:"healthy"`
	Reason  string `json:"reason,omitempty"`
	// PID is the daemon's process id as mps-host sees it (0: none runs).
	PID int `json:"pid,omitempty"`
	// Generation is the newest generation of desired.json whose limits for
	// this device the daemon is known to carry (0: none yet).
	Generation int64 `json:"generation,omitempty"`
}

// Duration is a time.Duration written as a string ("5s") in the files.
type Duration time.Duration

func (d Duration) MarshalJSON() ([]byte, error) {
	return json.Marshal(time.Duration(d).String())
}

func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("duration: %w", err)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

// validateDaemons checks a daemon list as Set takes it: at most maxDaemons,
// each valid, none listed twice, each in a folder of its own under the root.
// It returns the list by device.
func validateDaemons(daemons []Daemon) (map[string]Daemon, error) {
	if len(daemons) > maxDaemons {
		return nil, fmt.Errorf("%d mps daemons, more than the %d one node may run", len(daemons), maxDaemons)
	}
	byDevice := make(map[string]Daemon, len(daemons))
	byFolder := make(map[string]string, len(daemons))
	for _, d := range daemons {
		if err := d.Validate(); err != nil {
			return nil, err
		}
		if _, dup := byDevice[d.Device]; dup {
			return nil, fmt.Errorf("gpu %d (%s): mps daemon listed twice", d.Index, d.Device)
		}
		if other, dup := byFolder[dirName(d.Device)]; dup {
			return nil, fmt.Errorf("gpu %d (%s): mps daemon would share the folder %s with %s's", d.Index, d.Device, dirName(d.Device), other)
		}
		byDevice[d.Device] = d
		byFolder[dirName(d.Device)] = d.Device
	}
	return byDevice, nil
}

// readHostFile reads path, at most maxHostFileBytes of it. A missing file is
// an error for which errors.Is(err, fs.ErrNotExist) holds.
func readHostFile(path string) ([]byte, error) {
	b, err := atomicfile.ReadFile(path, maxHostFileBytes)
	if err != nil {
		// Wrapped, so callers still tell "missing" apart.
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return b, nil
}

// decodeHostFile checks b's version and decodes it strictly into v (a
// *DesiredFile or *HealthFile).
func decodeHostFile(b []byte, v any) error {
	if n := jsonValues(b); n > maxHostFileValues {
		return fmt.Errorf("%d of ',', '{' and '[', more than the %d a file of a few thousand devices holds; refused undecoded", n, maxHostFileValues)
	}
	// The version first: a file of another version is refused as that, not
	// for the fields it has that this one does not know.
	var head struct {
		Version int `json:"version"`
	}
	if err := json.Unmarshal(b, &head); err != nil {
		return err
	}
	if head.Version != FileVersion {
		return fmt.Errorf("version %d, this gpu-agent reads version %d", head.Version, FileVersion)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if dec.More() {
		return errors.New("data after the JSON object")
	}
	return nil
}

// jsonValues counts the bytes of b that separate or open a JSON value, also
// inside strings, so it bounds the values decoding can make.
func jsonValues(b []byte) int {
	n := 0
	for _, c := range b {
		switch c {
		case ',', '{', '[':
			n++
		}
	}
	return n
}

// ReadDesiredFile reads and validates a desired.json. A missing file is an
// error for which errors.Is(err, fs.ErrNotExist) holds.
func ReadDesiredFile(path string) (*DesiredFile, error) {
	b, err := readHostFile(path)
	if err != nil {
		return nil, err
	}
	f, err := parseDesiredFile(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return f, nil
}

// parseDesiredFile decodes and validates the content of a desired.json.
func parseDesiredFile(b []byte) (*DesiredFile, error) {
	var f DesiredFile
	if err := decodeHostFile(b, &f); err != nil {
		return nil, err
	}
	if f.Generation < 1 {
		return nil, fmt.Errorf("generation %d: must be at least 1", f.Generation)
	}
	if _, err := validateDaemons(f.Daemons); err != nil {
		return nil, fmt.Errorf("generation %d: %w", f.Generation, err)
	}
	return &f, nil
}

// ReadHealthFile reads a health.json. A missing file is an error for which
// errors.Is(err, fs.ErrNotExist) holds.
func ReadHealthFile(path string) (*HealthFile, error) {
	b, err := readHostFile(path)
	if err != nil {
		return nil, err
	}
	f, err := parseHealthFile(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return f, nil
}

// parseHealthFile decodes and checks the content of a health.json.
func parseHealthFile(b []byte) (*HealthFile, error) {
	var f HealthFile
	if err := decodeHostFile(b, &f); err != nil {
		return nil, err
	}
	if f.Interval <= 0 {
		return nil, fmt.Errorf("interval %v: must be positive", time.Duration(f.Interval))
	}
	return &f, nil
}

// writeJSONAtomic writes v as indented JSON to path with atomicfile.Write.
func writeJSONAtomic(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return atomicfile.Write(path, append(b, '\n'))
}
