package imex

import (
	"os"
	"testing"
)

func TestParseChannelCount(t *testing.T) {
	cases := []struct {
		in   string
		want int
		ok   bool
	}{
		{"ModifyDeviceFiles: 1\nImexChannelCount: 2048\nCreateImexChannel0: 0\n", 2048, true},
		{"ImexChannelCount:16", 16, true},
		{"ImexChannelCount: 0\n", 0, true},
		{"ModifyDeviceFiles: 1\n", 0, false},
		{"ImexChannelCount: -1\n", 0, false},
		{"ImexChannelCount: 2048\nImexChannelCount: 16\n", 0, false},
		{"ImexChannelCount: 99999999999\n", 0, false},
	}
	for _, c := range cases {
		got, err := ParseChannelCount([]byte(c.in))
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("%q: %d %v, want %d ok=%v", c.in, got, err, c.want, c.ok)
		}
	}
}

func TestParseCharMajor(t *testing.T) {
	devices := "Character devices:\n  1 mem\n195 nvidia\n234 nvidia-caps-imex-channels\n235 nvidia-caps\n\nBlock devices:\n  7 loop\n234 nvidia-caps-imex-channels-block\n"
	if m, err := ParseCharMajor([]byte(devices), channelDeviceName); err != nil || m != 234 {
		t.Errorf("major %d %v", m, err)
	}
	for _, bad := range []string{
		"Character devices:\n195 nvidia\n",
		"Block devices:\n234 nvidia-caps-imex-channels\n",
		"Character devices:\n234 nvidia-caps-imex-channels\n236 nvidia-caps-imex-channels\n",
		"Character devices:\nx nvidia-caps-imex-channels\n",
		"Character devices:\n99999 nvidia-caps-imex-channels\n",
	} {
		if m, err := ParseCharMajor([]byte(bad), channelDeviceName); err == nil {
			t.Errorf("%q: major %d, want an error", bad, m)
		}
	}
}

func FuzzParseChannelCount(f *testing.F) {
	f.Add([]byte("ModifyDeviceFiles: 1\nImexChannelCount: 2048\n"))
	f.Add([]byte("ImexChannelCount: -3"))
	f.Add([]byte(""))
	f.Fuzz(func(t *testing.T, b []byte) {
		n, err := ParseChannelCount(b)
		if err == nil && (n < 0 || n > maxChannels) {
			t.Fatalf("count %d accepted", n)
		}
	})
}

func FuzzParseCharMajor(f *testing.F) {
	f.Add([]byte("Character devices:\n234 nvidia-caps-imex-channels\n\nBlock devices:\n"))
	f.Add([]byte("Character devices:\n4096 nvidia-caps-imex-channels\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := ParseCharMajor(b, channelDeviceName)
		if err == nil && m >= 1<<12 {
			t.Fatalf("major %d accepted", m)
		}
	})
}

// The checkpoint decoder refuses what the driver cannot have written.
func FuzzDecodeState(f *testing.F) {
	f.Add([]byte(`{"version":1,"minor":0,"claims":[{"uid":"a","namespace":"n","name":"c","kind":"channel","domain":"d","devices":[{"requests":["r"],"device":"channel-0"}],"channels":[3]}]}`))
	f.Add([]byte(`{"version":1,"minor":1,"claims":[{"uid":"a","namespace":"n","name":"c","kind":"channel","domain":"d","devices":[{"requests":["r"],"device":"channel-0","shareID":"9f0c2b8e-5d0a-4c1e-8a43-2f7d0b1e6c55"}],"channels":[3]}]}`))
	f.Add([]byte(`{"version":2}`))
	f.Add([]byte(`{"version":1,"claims":[{"uid":"a","kind":"x","domain":"d"}]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		claims, err := decodeState(b)
		if err != nil {
			return
		}
		if err := checkClaims(claims); err != nil {
			t.Fatalf("decoded claims fail the check: %v", err)
		}
	})
}

// A checkpoint that cannot be read is set aside; one of a newer major is
// refused and left in place.
func TestLoadStateBad(t *testing.T) {
	dir := t.TempDir()
	if err := saveState(dir, []PreparedClaim{{UID: "a", Kind: KindChannel, Domain: "d", Channels: []int{1}}}); err != nil {
		t.Fatal(err)
	}
	if got, err := loadState(dir); err != nil || len(got) != 1 {
		t.Fatalf("round trip: %+v %v", got, err)
	}
	for _, c := range []struct {
		content string
		aside   bool
	}{{`{"version":1,"claims":[{"uid":"a","kind":"channel"}]}`, true}, {`not json`, true}, {`{"version":9}`, false}} {
		if err := writeFile(dir+"/"+StateFile, c.content); err != nil {
			t.Fatal(err)
		}
		got, err := loadState(dir)
		if err == nil || len(got) != 0 {
			t.Errorf("%s: %+v %v, want an error", c.content, got, err)
		}
		if _, statErr := statFile(dir + "/" + StateFile + ".unreadable"); (statErr == nil) != c.aside {
			t.Errorf("%s: set aside %v, want %v", c.content, statErr == nil, c.aside)
		}
		_ = removeFile(dir + "/" + StateFile + ".unreadable")
	}
}

func writeFile(p, s string) error            { return os.WriteFile(p, []byte(s), 0o644) }
func statFile(p string) (os.FileInfo, error) { return os.Stat(p) }
func removeFile(p string) error              { return os.Remove(p) }
