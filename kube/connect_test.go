package kube

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A person's command finds the kubeconfig as kubectl does: ~/.kube/config
// when neither --kubeconfig nor KUBECONFIG says otherwise.
func TestConnectAsKubectlReadsHomeConfig(t *testing.T) {
	home := t.TempDir()
	t.Setenv("HOME", home)
	t.Setenv("KUBECONFIG", "")
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	if err := os.MkdirAll(filepath.Join(home, ".kube"), 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: \"https://127.0.0.1:6443\"}\n" +
		"users:\n- name: u\n  user: {token: t}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\n"
	if err := os.WriteFile(filepath.Join(home, ".kube", "config"), []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	clients, how, err := ConnectAsKubectl("", "test")
	if err != nil || clients == nil || clients.Agent == nil {
		t.Fatalf("ConnectAsKubectl: %v, %v", clients, err)
	}
	if !strings.Contains(how, filepath.Join(home, ".kube", "config")) {
		t.Errorf("how = %q, want it to name ~/.kube/config", how)
	}
	// The agent itself never reads a person's file.
	if c, _, err := Connect("", "test"); c != nil || err != nil {
		t.Errorf("Connect without a kubeconfig or a cluster = %v, %v; want standalone", c, err)
	}
}
