{{/*
Names, labels and the addresses components give each other. Every address the chart writes is
made here, so the master, the nodes, the router and vLLM always agree.
*/}}

{{- define "kvpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvpool.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels of every object; call with (dict "ctx" $ "component" "master"). */}}
{{- define "kvpool.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvpool.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end }}

{{- define "kvpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpool.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvpool.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* ".<namespace>.svc.<cluster domain>": the suffix of every in-cluster host name. */}}
{{- define "kvpool.svcSuffix" -}}
{{- printf ".%s.svc.%s" .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{- define "kvpool.etcdName" -}}
{{- printf "%s-etcd" (include "kvpool.fullname" .) }}
{{- end }}

{{/* etcd client endpoints as HOST:PORT,HOST:PORT: the chart's own members, or etcd.endpoints. */}}
{{- define "kvpool.etcdEndpoints" -}}
{{- if .Values.etcd.enabled }}
{{- $etcd := include "kvpool.etcdName" . }}
{{- $suffix := include "kvpool.svcSuffix" . }}
{{- $endpoints := list }}
{{- range $i := until (int .Values.etcd.replicas) }}
{{- $endpoints = append $endpoints (printf "%s-%d.%s%s:%d" $etcd $i $etcd $suffix (int $.Values.etcd.clientPort)) }}
{{- end }}
{{- join "," $endpoints }}
{{- else }}
{{- join "," .Values.etcd.endpoints }}
{{- end }}
{{- end }}

{{/* The election's name in etcd (kvpool master --ha-name). */}}
{{- define "kvpool.haName" -}}
{{- default .Release.Name .Values.master.ha.name }}
{{- end }}

{{/* The Service that reaches the one master when HA is off. */}}
{{- define "kvpool.masterServiceName" -}}
{{- printf "%s-master" (include "kvpool.fullname" .) }}
{{- end }}

{{/*
Where nodes, the router and vLLM find the master: etcd://ENDPOINTS/NAME with HA (they follow
whoever holds the lease), else the master Service's tcp:// address.
*/}}
{{- define "kvpool.masterAddress" -}}
{{- if .Values.master.ha.enabled }}
{{- printf "etcd://%s/%s" (include "kvpool.etcdEndpoints" .) (include "kvpool.haName" .) }}
{{- else }}
{{- printf "tcp://%s%s:%d" (include "kvpool.masterServiceName" .) (include "kvpool.svcSuffix" .) (int .Values.master.port) }}
{{- end }}
{{- end }}

{{/* Settings that cannot work together fail the render with what to change. */}}
{{- define "kvpool.validate" -}}
{{- if and .Values.master.ha.enabled (not .Values.etcd.enabled) (empty .Values.etcd.endpoints) }}
{{- fail "master.ha.enabled needs etcd: set etcd.enabled=true or list etcd.endpoints (HOST:PORT)" }}
{{- end }}
{{- if and (not .Values.master.ha.enabled) (ne (int .Values.master.replicas) 1) }}
{{- fail "without master.ha.enabled exactly one master may run: set master.replicas=1" }}
{{- end }}
{{- if and .Values.etcd.enabled (ne (mod (int .Values.etcd.replicas) 2) 1) }}
{{- fail "etcd.replicas must be odd (1 or 3): an even member count tolerates no more failures" }}
{{- end }}
{{- if lt (int .Values.node.memoryGiB) 1 }}
{{- fail "node.memoryGiB must be a whole number of GiB, at least 1" }}
{{- end }}
{{- end }}

{{/* The node's container memory: its segment plus the process's own. */}}
{{- define "kvpool.nodeMemory" -}}
{{- printf "%dMi" (add (mul (int .Values.node.memoryGiB) 1024) (int .Values.node.memoryOverheadMiB)) }}
{{- end }}

{{/* The connector's --kv-transfer-config, as `kvpool connector-config --master ADDR --set ...` prints it. */}}
{{- define "kvpool.kvTransferConfig" -}}
{{- $extra := dict "master_address" (include "kvpool.masterAddress" .) }}
{{- if .Values.auth.enabled }}
{{- $_ := set $extra "credential" "/etc/kvpool/tenant/tenant.cred" }}
{{- end }}
{{- $extra = merge $extra (deepCopy .Values.vllm.connectorExtraConfig) }}
{{- $config := dict "kv_connector" "KVPoolConnector" "kv_connector_module_path" "kvpool.connector" "kv_role" "kv_both" "kv_load_failure_policy" "recompute" "kv_connector_extra_config" $extra }}
{{- toJson $config }}
{{- end }}
